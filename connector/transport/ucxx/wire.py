"""The wire of the UCXX transport: tags, messages, run planning and the target's checks.

Pure numpy and msgpack, no UCX: :mod:`kvbridge.connector.transport.ucxx.transport` (in
every process that runs a UCXX transport) builds and parses what is here,
and tests exercise the checks without a peer.

**Protocol** (control messages are kvbridge msgpack envelopes with tag
``CTRL``; replies carry tag ``REPLY|xfer|step`` and a 4-byte length):

- ``metadata()`` is ``{name, UCX worker address}``. ``connect()`` opens the
  endpoints and sends ``hello {from, address, xfer}``; the peer opens
  endpoints back and replies, which proves its service thread answers.
- READ: the reader plans *runs* (descriptor rows from
  :func:`~kvbridge.connector.transport.nixl_descs.descriptor_table`, neighbours adjacent
  on both sides merged), pre-posts one tagged receive per run into its own
  memory (tag ``DATA|xfer|i``, ``xfer`` its own never-reused transfer id),
  then sends ``read {from, xfer, mem, group, per_span, rows, sizes, notify,
  timeout_s}``. The target checks every row and size against its own table
  and regions, tag-sends each run from its memory and replies ok (or the
  reason it refused). Done when every run and the reply arrived.
- WRITE: the writer sends ``write`` with the same fields; the target checks,
  pre-posts receives into its memory (tags from *its* transfer ids, since
  many writers share its worker), replies ``go {tag}``; the writer sends the
  runs; the target replies ``done`` when all arrived (or its deadline passed).
- ``notify`` bytes reach the owner's :meth:`UcxxTransport.poll_notifications`, under the
  initiator's name, once the owner's side of the transfer completed;
  :meth:`UcxxTransport.send_notification` sends a ``notify`` message.
- A peer message that fails a check is answered with an error reply when it
  names a transfer, else logged and dropped; it never touches memory and
  never stops the service thread. Unexpected data or reply messages (a late
  message of a timed-out transfer) are drained into scratch buffers.

Tags are 64 bits: the top 4 say what a message is (:data:`CTRL` to a peer's
service thread, :data:`REPLY` to one of our transfers, :data:`DATA` for
block bytes). A data tag holds the *receiving* process's transfer id and
the message's index; a reply tag holds the initiator's transfer id and a
step. Transfer ids are never reused by a process, so a late message of a
timed-out transfer can only match that transfer's (cancelled) receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.proto import codec
from kvbridge.proto.errors import LayoutError, WireError
from kvbridge.proto.layout import KVGroup, KVLayout

__all__ = [
    "CTRL",
    "DATA",
    "KIND_MASK",
    "MAX_MESSAGES",
    "MAX_XFER",
    "Plan",
    "UcxxAgentInfo",
    "check_runs",
    "data_tag",
    "decode",
    "decode_reply",
    "encode",
    "encode_reply",
    "plan_runs",
    "region_bounds",
    "reply_tag",
    "take_int",
    "take_optional_bytes",
    "REPLY",
]

KIND_MASK = 0xF << 60
CTRL = 0x1 << 60
REPLY = 0x2 << 60
DATA = 0x3 << 60
_INDEX_BITS = 24
MAX_MESSAGES = 1 << _INDEX_BITS
MAX_XFER = 1 << (60 - _INDEX_BITS)

_CTRL_KIND = "ucxx-ctrl"
_AGENT_KIND = "ucxx-agent"
_MAX_ADDRESS = 1 << 16


def data_tag(xfer: int, index: int) -> int:
    """Tag of data message ``index`` of transfer ``xfer`` (ids of the receiving process)."""
    # raised, not asserted: ``xfer`` may be a peer's id, and a value outside its bits would
    # turn the tag into another kind of message under ``python -O``
    _check_tag_field("transfer id", xfer, 1, MAX_XFER - 1)
    _check_tag_field("message index", index, 0, MAX_MESSAGES - 1)
    return DATA | (xfer << _INDEX_BITS) | index


def reply_tag(xfer: int, step: int) -> int:
    """Tag of reply ``step`` (0: accepted/go, 1: done) to the initiator's transfer ``xfer``."""
    _check_tag_field("transfer id", xfer, 1, MAX_XFER - 1)
    _check_tag_field("reply step", step, 0, 255)
    return REPLY | (xfer << 8) | step


def _check_tag_field(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise WireError(f"{name} {value} is outside {lo}..{hi} and cannot be put in a tag")


def encode(body: Mapping[str, Any]) -> bytes:
    """A control message or reply, in kvbridge's versioned msgpack envelope."""
    return codec.pack(_CTRL_KIND, body)


def decode(data: bytes | bytearray | memoryview, max_bytes: int) -> dict[str, Any]:
    """Parse a peer's control message or reply; WireError for anything malformed."""
    return codec.unpack(bytes(data), _CTRL_KIND, max_bytes=max_bytes)


def encode_reply(body: Mapping[str, Any]) -> bytes:
    """A reply, prefixed with its 4-byte length (it lands in a fixed-size buffer)."""
    data = encode(body)
    return len(data).to_bytes(4, "little") + data


def decode_reply(buf: bytes | bytearray, max_bytes: int) -> dict[str, Any]:
    """Parse a reply received into a fixed-size buffer; WireError for anything malformed."""
    n = int.from_bytes(bytes(buf[:4]), "little")
    if not 0 < n <= len(buf) - 4:
        raise WireError(f"reply length {n} does not fit its {len(buf)}-byte buffer")
    return decode(memoryview(buf)[4 : 4 + n], max_bytes)


@dataclass(frozen=True, slots=True)
class UcxxAgentInfo:
    """What :meth:`UcxxTransport.metadata` sends: the agent's name and UCX worker address."""

    name: str
    address: bytes

    def to_bytes(self) -> bytes:
        return codec.pack(_AGENT_KIND, {"name": self.name, "address": self.address})

    @classmethod
    def from_bytes(cls, data: bytes) -> UcxxAgentInfo:
        body = codec.unpack(data, _AGENT_KIND, max_bytes=_MAX_ADDRESS + 4096)
        name = codec.take(body, "name", str)
        address = codec.take(body, "address", bytes)
        if not name or not address:
            raise WireError("UCXX agent metadata needs a non-empty name and worker address")
        return cls(name, address)


@dataclass(frozen=True, slots=True)
class Plan:
    """The messages of one transfer: local address, remote table row, bytes; one per run."""

    local_addrs: npt.NDArray[np.uint64]
    remote_rows: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    def wire(self) -> dict[str, bytes]:
        """The remote half, as the request carries it (little-endian int64 arrays)."""
        return {
            "rows": self.remote_rows.astype("<i8").tobytes(),
            "sizes": self.sizes.astype("<i8").tobytes(),
        }


def plan_runs(
    local_table: npt.NDArray[np.uint64],
    remote_table: npt.NDArray[np.uint64],
    local_rows: npt.NDArray[np.int32],
    remote_rows: npt.NDArray[np.int32],
    coalesce: bool,
) -> Plan:
    """Pair descriptor rows and merge neighbours that are adjacent on both sides.

    Rows come from :func:`~kvbridge.connector.transport.nixl_descs.descriptor_indices`;
    every row of both tables has the same length (the negotiated mode makes
    spans or blocks equal on both sides). Pairs are ordered by local address
    and a run grows while the next pair continues both the local and the
    remote bytes, so sequential block ids become a few large messages.
    """
    length = int(local_table[0, 1])
    if length != int(remote_table[0, 1]):  # the remote table comes from the peer's layout
        raise LayoutError(
            f"local descriptors are {length} bytes, the peer's {int(remote_table[0, 1])}: "
            "the negotiated mode should have made them equal; reconnect"
        )
    la = local_table[local_rows, 0]
    ra = remote_table[remote_rows, 0]
    rows = remote_rows.astype(np.int64)
    if coalesce and la.shape[0] > 1:
        order = np.argsort(la, kind="stable")
        la, ra, rows = la[order], ra[order], rows[order]
        step = np.uint64(length)
        brk = (la[1:] != la[:-1] + step) | (ra[1:] != ra[:-1] + step)
        starts = np.flatnonzero(np.concatenate(([True], brk)))
    else:
        starts = np.arange(la.shape[0])
    counts = np.diff(np.append(starts, la.shape[0]))
    return Plan(la[starts], rows[starts], counts.astype(np.int64) * length)


def region_bounds(layout: KVLayout, group: KVGroup) -> npt.NDArray[np.uint64]:
    """Kx2 ``[start, end)`` of ``group``'s registered regions, sorted by start."""
    spans = sorted(
        (r.addr, r.addr + r.length) for r in (layout.regions[i] for i in layout.regions_of(group))
    )
    return np.array(spans, dtype=np.uint64).reshape(-1, 2)


def check_runs(
    table: npt.NDArray[np.uint64],
    bounds: npt.NDArray[np.uint64],
    rows_wire: object,
    sizes_wire: object,
) -> list[tuple[int, int]]:
    """The target's check of a peer's runs against ITS OWN table; ``(address, bytes)`` each.

    ``table`` is this process's descriptor table of the group (rows =
    block ids x spans per block), ``bounds`` its regions. Every row must be
    in the table, every size a positive multiple of the descriptor length,
    and every run must end inside the region it starts in. Raises WireError
    naming the first bad value; nothing is touched before all runs pass.
    """
    if not isinstance(rows_wire, bytes) or not isinstance(sizes_wire, bytes):
        raise WireError("rows and sizes must be bytes of little-endian int64")
    if len(rows_wire) != len(sizes_wire) or len(rows_wire) % 8:
        raise WireError(
            f"rows ({len(rows_wire)} bytes) and sizes ({len(sizes_wire)} bytes) must be "
            "equally long int64 arrays"
        )
    rows = np.frombuffer(rows_wire, dtype="<i8")
    sizes = np.frombuffer(sizes_wire, dtype="<i8")
    if not 0 < rows.shape[0] <= MAX_MESSAGES:
        raise WireError(f"a transfer has 1..{MAX_MESSAGES} messages, got {rows.shape[0]}")
    n, length = table.shape[0], int(table[0, 1])
    bad = np.flatnonzero((rows < 0) | (rows >= n))
    if bad.size:
        raise WireError(f"row {int(rows[bad[0]])} is outside this memory's 0..{n - 1}")
    bad = np.flatnonzero((sizes <= 0) | (sizes % length != 0) | (sizes > n * length))
    if bad.size:
        raise WireError(
            f"size {int(sizes[bad[0]])} is not a positive multiple of the {length}-byte descriptor"
        )
    addrs = table[rows, 0]
    ends = addrs + sizes.astype(np.uint64)
    region = np.searchsorted(bounds[:, 0], addrs, side="right") - 1
    inside = (region >= 0) & (ends <= bounds[np.maximum(region, 0), 1])
    bad = np.flatnonzero(~inside)
    if bad.size:
        i = int(bad[0])
        raise WireError(
            f"run at row {int(rows[i])} of {int(sizes[i])} bytes ends outside its region"
        )
    return list(zip(addrs.tolist(), sizes.tolist(), strict=True))


def take_int(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    """``body[name]`` as an int in ``lo..hi``; WireError otherwise."""
    value = codec.take(body, name, int)
    if not lo <= value <= hi:
        raise WireError(f"field {name!r}={value} is outside {lo}..{hi}")
    return value


def take_optional_bytes(body: Mapping[str, Any], name: str, limit: int) -> bytes | None:
    """``body[name]`` as bytes of at most ``limit`` bytes, or None when absent/nil."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) > limit:
        raise WireError(f"field {name!r} must be bytes of at most {limit} bytes")
    return value

"""Lease seals: a one-sided proof that leased blocks were not reused while a peer read them.

The owner's :class:`SealTable` (beside its lease table) lives here, the reader's
:class:`~kvbridge.connector.control.seal_reader.SealReader` (decode's worker half)
in :mod:`.seal_reader`; leases given back by notification are
:mod:`kvbridge.connector.control.releases`.

The owner of leased blocks (a prefill's control server, in kvbridge's node or
in vLLM's worker) keeps a small table in NIXL-registered memory. While a lease
is held, one 64-byte slot of that table holds the lease's **seal**: the lease's
nonce (its 16-byte id) and a digest of exactly which block ids hold exactly
which block names (:func:`seal_digest`). The slot is written after the blocks'
KV is complete (the lease is made for a finished request) and zeroed before the
lease's pin is dropped (release, expiry, shutdown), so before any block of it
can be reused.

A decode that READs the blocks and *then* READs the seal slot and finds the
seal it expects knows three things without a control RPC:

- the owner leased exactly these ids under exactly the names decode computed
  from its own prompt (forged or swapped ids give another digest);
- the lease was alive when the seal was read, and it was alive when decode
  got the lease id (from prefill's answer), so it was alive during the whole
  block READ in between; lease ids never repeat, so a lease that lapsed and a
  new one over the same blocks gives another nonce;
- hence the blocks held the named KV for the whole read.

When the owner also recorded its blocks' digests (vLLM's worker, under the
hand-over's secret digest key), the slot's last 16 bytes hold a **content tag**
(:func:`content_tag`): a MAC, under that key, of the lease's nonce, its seal and
every leased block's digest. A reader that read every leased block computes the
digests of what landed and the tag they make; a slot holding that tag proves
the bytes too, with no ``Digests`` round trip. The slot is registered memory, so
a token holder can write it, but without the key (only in the params, router to
decode, and in the owner's process) it cannot make a tag that matches other
bytes: a wrong tag is the slow path, never a load of wrong bytes. A reader that
verifies nothing (or read only part of the lease) compares the first 48 bytes.

Anything else (no slot, another seal, a READ error) sends the load to the slow
path, where the owner names the blocks over the control plane. A good seal lets
the load finish without a control RPC; the reader then gives the lease back by
a NIXL notification, which costs no round trip (:mod:`.releases`).

The table itself is described by a tiny :class:`KVLayout` (``seal_layout``:
one group ``seal``, 64 bytes per "block") so the transport moves it like any
KV: one descriptor per slot, ids checked against the layout.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import GroupSpec, KVGroup, KVLayout, LayerSpec, ModelSpec
from kvbridge.proto.types import BlockHash, BlockId

if TYPE_CHECKING:
    import torch


__all__ = [
    "PROBES",
    "SEAL_BYTES",
    "SEAL_GROUP",
    "SEAL_POLL_S",
    "SEAL_WAIT_S",
    "SealTable",
    "TAG_BYTES",
    "content_tag",
    "expected_seal",
    "is_seal_layout",
    "probe_slots",
    "seal_digest",
    "seal_layout",
    "slot_rows",
]

SEAL_BYTES = 64
"""One slot: 16-byte lease nonce, 32-byte seal digest, 16-byte content tag (zero: the owner
recorded no digests)."""
TAG_BYTES = 16
"""The content tag's length (:func:`content_tag`)."""
SEALED_BYTES = SEAL_BYTES - TAG_BYTES
"""The bytes every reader compares: nonce and seal digest."""
SEAL_GROUP = KVGroup.SELF
"""The seal table's one group (named like the KV default group, which transports expect)."""
PROBES = 4
"""A lease's seal sits in one of the ``PROBES`` slots after its home slot."""
_MODEL = "kvbridge-seal-v1"
SEAL_POLL_S = 0.002
"""How often a load waiting on a pool thread for an owner to seal its lease READs the slots
again (``wait_s``; a load driven from the engine's thread reads them again at its next poll)."""
SEAL_WAIT_S = 0.05
"""How long a load reads again a seal whose nonce is in no probe slot yet before it takes
the seal as not holding (and asks the owner): vLLM's prefill worker makes a lease, and seals
it, at the engine step after its scheduler's answer named it, and a decode can read before
that step ran."""
RANKS_AT_ONCE = 8
"""Owners whose seals one :meth:`SealReader.holds_all` READs at once (scratch is sized so
that every concurrent load can)."""

log = logging.getLogger(__name__)


def seal_layout(num_slots: int) -> KVLayout:
    """The layout of a seal table (or of a reader's scratch slots): 64 bytes per slot."""
    if num_slots < PROBES:
        raise LayoutError(f"a seal table needs at least {PROBES} slots, got {num_slots}")
    return KVLayout(
        model=ModelSpec(_MODEL, "uint8", num_layers=1, num_kv_heads=1, head_size=SEAL_BYTES // 2),
        block_size=1,
        groups=(GroupSpec(SEAL_GROUP, num_slots),),
        layers=(LayerSpec("seal", group=SEAL_GROUP),),
    )


def is_seal_layout(layout: KVLayout) -> bool:
    """Whether a peer's layout is a seal table's (checked before connecting to it)."""
    return (
        layout.model.name == _MODEL
        and layout.block_bytes(SEAL_GROUP) == SEAL_BYTES
        and len(layout.groups) == 1
    )


def seal_digest(
    blocks: Mapping[KVGroup, Sequence[BlockId]], names: Mapping[KVGroup, Sequence[BlockHash]]
) -> bytes:
    """32 bytes naming which ids hold which names, over every group of a lease."""
    h = hashlib.sha256(b"kvbridge-seal-v1\0")
    for group in sorted(set(blocks) | set(names)):
        ids, hashes = blocks.get(group, ()), names.get(group, ())
        h.update(group.encode() + b"\0" + len(ids).to_bytes(4, "little"))
        h.update(b"".join(int(b).to_bytes(8, "little") for b in ids))
        h.update(len(hashes).to_bytes(4, "little") + b"".join(hashes))
    return h.digest()


_LEASE_ID = re.compile(r"[0-9a-f]{32}")


def content_tag(
    lease_id: str,
    digest: bytes,
    key: int,
    algo: str,
    digests: Mapping[KVGroup, Sequence[bytes]],
) -> bytes:
    """The 16-byte MAC binding a lease's nonce and seal ``digest`` to every leased block's
    ``algo`` digest under the hand-over's secret ``key`` (BLAKE2b keyed with it). Groups
    without blocks are left out, so the owner and a reader that read every block agree."""
    h = hashlib.blake2b(
        digest_size=TAG_BYTES, key=key.to_bytes(8, "little"), person=b"kvbridge-tag-v1"
    )
    h.update(lease_id.encode() + b"\0" + digest + algo.encode() + b"\0")
    for group in sorted(g for g, d in digests.items() if d):
        h.update(group.encode() + b"\0" + len(digests[group]).to_bytes(4, "little"))
        h.update(b"".join(digests[group]))
    return h.digest()


def expected_seal(lease_id: str, digest: bytes, tag: bytes = b"") -> bytes:
    """The 64 bytes a live lease's slot holds (``tag``: its content tag; none: zeros);
    ValueError for a lease id that is not 32 lowercase hex digits (the only ids a lease
    has, and the only ones a release names)."""
    if not _LEASE_ID.fullmatch(lease_id):
        raise ValueError(f"lease id {lease_id[:40]!r} is not 32 lowercase hex digits")
    nonce = bytes.fromhex(lease_id)
    if len(nonce) != 16 or len(digest) != 32 or len(tag) not in (0, TAG_BYTES):
        raise ValueError("a seal needs a 16-byte lease id, a 32-byte digest and a 16-byte tag")
    return nonce + digest + (tag or bytes(TAG_BYTES))


def probe_slots(lease_id: str, num_slots: int) -> list[BlockId]:
    """The slots a lease's seal may sit in, home slot first."""
    home = int(lease_id[:8], 16) % num_slots
    return [BlockId((home + i) % num_slots) for i in range(PROBES)]


def slot_rows(tensor: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``(num_slots, 64)`` bytes over a seal layout's one (strided) layer view."""
    import torch

    return torch.as_strided(tensor, (num_slots, SEAL_BYTES), (SEAL_BYTES, 1))


class SealTable:
    """The owner's seal slots, in memory the caller registers with its transport.

    Thread-safe: leases are made on the scheduler thread and end on the
    control server's threads and its reaper.
    """

    def __init__(self, num_slots: int, device: str = "cpu") -> None:
        self.layout = seal_layout(num_slots)
        self.tensors: dict[str, torch.Tensor] = self.layout.allocate(device)
        (tensor,) = self.tensors.values()
        self._slots = slot_rows(tensor, num_slots)
        self._taken: dict[str, int] = {}
        """Slot of each sealed lease."""
        self._used: set[int] = set()
        """The slots in ``_taken``, for the probe."""
        self._lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return self.layout.groups[0].num_blocks

    def publish(self, lease_id: str, digest: bytes, tag: bytes = b"") -> bool:
        """Write a lease's seal (with its content ``tag``, if any); False (no seal: readers
        take the slow path) if its probe slots are all taken or the id is not a 32-digit
        hex lease id."""
        import torch

        try:
            seal = expected_seal(lease_id, digest, tag)
        except ValueError:
            return False
        with self._lock:
            for slot in probe_slots(lease_id, self.num_slots):
                if slot not in self._used:
                    self._slots[slot] = torch.frombuffer(bytearray(seal), dtype=torch.uint8)
                    self._taken[lease_id] = slot
                    self._used.add(slot)
                    return True
        return False

    def retract(self, lease_id: str) -> None:
        """Zero a lease's seal (before its blocks may be reused); no-op if it had none."""
        with self._lock:
            slot = self._taken.pop(lease_id, None)
            if slot is not None:
                self._slots[slot].zero_()
                self._used.discard(slot)

    def num_sealed(self) -> int:
        with self._lock:
            return len(self._taken)

"""Lease seals: a one-sided proof that leased blocks were not reused while a peer read them.

Both ends live here: the owner's :class:`SealTable` (beside its lease table)
and the reader's :class:`SealReader` (decode's worker half); leases given back
by notification are :mod:`kvbridge.connector.control.releases`.

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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.control.releases import release_message
from kvbridge.proto.errors import KVBridgeError, LayoutError, OutOfBlocksError
from kvbridge.proto.layout import GroupSpec, KVGroup, KVLayout, LayerSpec, ModelSpec
from kvbridge.proto.types import BlockHash, BlockId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import PeerLink, TransferHandle, Transport

__all__ = [
    "PROBES",
    "SealReader",
    "SEAL_BYTES",
    "SEAL_GROUP",
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
_SEALED = SEAL_BYTES - TAG_BYTES
"""The bytes every reader compares: nonce and seal digest."""
SEAL_GROUP = KVGroup.SELF
"""The seal table's one group (named like the KV default group, which transports expect)."""
PROBES = 4
"""A lease's seal sits in one of the ``PROBES`` slots after its home slot."""
_MODEL = "kvbridge-seal-v1"
SEAL_POLL_S = 0.002
"""How often a load that found no seal for its lease READs the slots again (``wait_s``)."""
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


class SealReader:
    """Decode's side: scratch slots and seal checks; thread-safe (loads run in a pool)."""

    def __init__(self, transport: Transport, max_concurrent: int) -> None:
        self.transport = transport
        layout = seal_layout(PROBES * RANKS_AT_ONCE * max(1, max_concurrent))
        self._caches = layout.allocate("cpu")
        (tensor,) = self._caches.values()
        self._slots = slot_rows(tensor, layout.groups[0].num_blocks)
        self.memory = transport.register(layout, self._caches)
        self._free = [BlockId(i) for i in range(layout.groups[0].num_blocks)]
        self._lock = threading.Lock()

    def connect(self, peer_name: str, metadata: bytes, seal: KVLayout) -> PeerLink:
        """A link from the scratch slots to a peer's seal table."""
        return self.transport.connect(peer_name, metadata, seal, self.memory)

    def holds(
        self,
        link: PeerLink,
        lease_id: str,
        digest: bytes,
        timeout_s: float,
        meanwhile: Callable[[], object] | None = None,
        tag: Callable[[], bytes | None] | None = None,
        wait_s: float = 0.0,
    ) -> bool:
        """READ the lease's probe slots from the owner; True if one holds exactly the
        expected seal. Any failure is False (the caller takes the slow path).
        ``meanwhile`` runs while the seal READ is in flight (it must not raise).
        ``tag``: the content tag the slot must also hold, asked for after ``meanwhile``
        (None from it: no tag can be made, the seal does not hold); without it the
        slot's tag bytes are not compared. ``wait_s``: while no probe slot holds the
        lease's nonce at all (an owner that makes its lease a step after handing out its
        id, as vLLM's worker does, may not have sealed it yet), READ the slots again,
        every :data:`SEAL_POLL_S`, for up to this long; a slot that holds the nonce with
        another digest or tag is an answer at once."""
        deadline = time.monotonic() + wait_s
        while True:
            absent: list[bool] = []
            args = (lease_id, digest, timeout_s, meanwhile, tag, absent)
            held = self.holds_all([link], *args)[0]
            if held or absent != [True] or time.monotonic() + SEAL_POLL_S > deadline:
                return held
            meanwhile = None  # it ran while the first READ was in flight
            time.sleep(SEAL_POLL_S)

    def holds_all(
        self,
        links: Sequence[PeerLink],
        lease_id: str,
        digest: bytes,
        timeout_s: float,
        meanwhile: Callable[[], object] | None = None,
        tag: Callable[[], bytes | None] | None = None,
        absent: list[bool] | None = None,
    ) -> list[bool]:
        """:meth:`holds` for the same lease at several owners (the TP ranks of one engine),
        every seal READ posted before the first is waited for (at most
        :data:`RANKS_AT_ONCE` at a time). ``tag`` (one owner's content tag) needs one
        link. ``absent`` gets, per link, whether no probe slot held the lease's nonce."""
        if (tag is not None or absent is not None) and len(links) != 1:
            raise ValueError("a content tag is one owner's: check it over one link")
        if len(links) > RANKS_AT_ONCE:
            head = self.holds_all(links[:RANKS_AT_ONCE], lease_id, digest, timeout_s, meanwhile)
            return head + self.holds_all(links[RANKS_AT_ONCE:], lease_id, digest, timeout_s)
        try:
            want = expected_seal(lease_id, digest)
        except ValueError:
            return [False] * len(links)
        n = PROBES * len(links)
        with self._lock:
            if len(self._free) < n:
                raise OutOfBlocksError("no free seal scratch slots (more loads than configured)")
            mine, self._free = self._free[:n], self._free[n:]
        handles: list[TransferHandle | None] = []
        try:
            for i, link in enumerate(links):
                remote = probe_slots(lease_id, link.remote_layout.groups[0].num_blocks)
                slots = mine[i * PROBES : (i + 1) * PROBES]
                try:
                    handles.append(
                        self.transport.read_blocks(
                            link, SEAL_GROUP, slots, remote, timeout_s=timeout_s
                        )
                    )
                except KVBridgeError as exc:
                    log.info("reading the seal of lease %s failed (%s)", lease_id, exc)
                    handles.append(None)
            if meanwhile is not None:
                meanwhile()
            want_tag = None if tag is None else tag()
            # a tag that could not be made holds nothing (the READs are still waited for)
            no_tag = tag is not None and (want_tag is None or len(want_tag) != TAG_BYTES)
            want = want[:_SEALED] + (want_tag or b"")
            held = []
            for i, handle in enumerate(handles):
                if handle is None:
                    held.append(False)
                    continue
                try:
                    handle.wait(timeout_s)
                except KVBridgeError as exc:
                    log.info("reading the seal of lease %s failed (%s)", lease_id, exc)
                    held.append(False)
                    continue
                mine_i = mine[i * PROBES : (i + 1) * PROBES]
                got = [self._slots[s].numpy().tobytes() for s in mine_i]
                held.append(not no_tag and any(slot[: len(want)] == want for slot in got))
                if absent is not None:
                    absent.append(all(slot[:16] != want[:16] for slot in got))
            return held
        finally:
            for handle in handles:
                if handle is not None:
                    handle.release()
            with self._lock:
                self._free.extend(mine)

    def warm(self, link: PeerLink, timeout_s: float) -> float:
        """READ one of the peer's seal slots and throw it away: a new link's first transfer
        pays UCX's endpoint wireup (tens to hundreds of ms on a busy peer, which must
        progress it), and this makes the handshake pay it instead of the first loads. The
        KV link to the same peer shares the endpoint. Seconds it took; raises on failure."""
        with self._lock:
            if not self._free:
                raise OutOfBlocksError("no free seal scratch slot for the link warm-up")
            mine = self._free.pop()
        t0 = time.perf_counter()
        try:
            handle = self.transport.read_blocks(
                link, SEAL_GROUP, [mine], [BlockId(0)], timeout_s=timeout_s
            )
            try:
                handle.wait(timeout_s)
            finally:
                handle.release()
        finally:
            with self._lock:
                self._free.append(mine)
        return time.perf_counter() - t0

    def release(self, link: PeerLink, lease_id: str, reader: int = 0, readers: int = 1) -> None:
        """Give a lease back without a round trip (best effort: unsent, it expires); as
        ``reader`` of ``readers`` when several ranks read it (:func:`release_message`)."""
        try:
            self.transport.send_notification(link, release_message(lease_id, reader, readers))
        except KVBridgeError as exc:
            log.info("release notification for lease %s failed (%s); it will expire", lease_id, exc)

    def close(self) -> None:
        self.transport.unregister(self.memory)

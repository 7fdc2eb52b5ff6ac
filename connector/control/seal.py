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

Anything else (no slot, another seal, a READ error) sends the load to the slow
path, where the owner names the blocks over the control plane. A good seal lets
the load finish without a control RPC; the reader then gives the lease back by
a NIXL notification, which costs no round trip (:mod:`.releases`).

The table itself is described by a tiny :class:`KVLayout` (``seal_layout``:
one group ``seal``, 64 bytes per "block") so the transport moves it like any
KV: one descriptor per slot, ids checked against the layout.
"""

from __future__ import annotations

import contextlib
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
    "SealCheck",
    "SealReader",
    "SEAL_BYTES",
    "SEAL_GROUP",
    "SealTable",
    "expected_seal",
    "is_seal_layout",
    "probe_slots",
    "seal_digest",
    "seal_layout",
    "slot_rows",
]

SEAL_BYTES = 64
"""One slot: 16-byte lease nonce, 32-byte digest, 16 bytes zero."""
SEAL_GROUP = KVGroup.SELF
"""The seal table's one group (named like the KV default group, which transports expect)."""
PROBES = 4
"""A lease's seal sits in one of the ``PROBES`` slots after its home slot."""
_MODEL = "kvbridge-seal-v1"
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


def expected_seal(lease_id: str, digest: bytes) -> bytes:
    """The 64 bytes a live lease's slot holds; ValueError for a lease id that is not 32
    lowercase hex digits (the only ids a lease has, and the only ones a release names)."""
    if not _LEASE_ID.fullmatch(lease_id):
        raise ValueError(f"lease id {lease_id[:40]!r} is not 32 lowercase hex digits")
    nonce = bytes.fromhex(lease_id)
    if len(nonce) != 16 or len(digest) != 32:
        raise ValueError("a seal needs a 16-byte lease id and a 32-byte digest")
    return nonce + digest + bytes(SEAL_BYTES - 48)


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

    def publish(self, lease_id: str, digest: bytes) -> bool:
        """Write a lease's seal; False (no seal: readers take the slow path) if its probe
        slots are all taken or the id is not a 32-digit hex lease id."""
        import torch

        try:
            seal = expected_seal(lease_id, digest)
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
    ) -> bool:
        """READ the lease's probe slots from the owner; True if one holds exactly the
        expected seal. Any failure is False (the caller takes the slow path).
        ``meanwhile`` runs while the seal READ is in flight (it must not raise)."""
        return self.holds_all([link], lease_id, digest, timeout_s, meanwhile)[0]

    def holds_all(
        self,
        links: Sequence[PeerLink],
        lease_id: str,
        digest: bytes,
        timeout_s: float,
        meanwhile: Callable[[], object] | None = None,
    ) -> list[bool]:
        """:meth:`holds` for the same lease at several owners (the TP ranks of one engine),
        every seal READ posted before the first is waited for (at most
        :data:`RANKS_AT_ONCE` at a time)."""
        if len(links) > RANKS_AT_ONCE:
            head = self.holds_all(links[:RANKS_AT_ONCE], lease_id, digest, timeout_s, meanwhile)
            return head + self.holds_all(links[RANKS_AT_ONCE:], lease_id, digest, timeout_s)
        check = self.post(links, lease_id, digest, timeout_s)
        if check is None:
            return [False] * len(links)
        try:
            if meanwhile is not None:
                meanwhile()
            return check.wait(timeout_s)
        finally:
            check.close()

    def post(
        self, links: Sequence[PeerLink], lease_id: str, digest: bytes, timeout_s: float
    ) -> SealCheck | None:
        """Post the seal READs of :meth:`holds_all` (at most :data:`RANKS_AT_ONCE` links) and
        return at once: the caller polls the :class:`SealCheck` (never blocks) or waits for
        it. None: ``lease_id`` is no lease id (no seal can hold)."""
        if len(links) > RANKS_AT_ONCE:
            raise OutOfBlocksError(f"more than {RANKS_AT_ONCE} seals at once")
        try:
            want = expected_seal(lease_id, digest)
        except ValueError:
            return None
        n = PROBES * len(links)
        with self._lock:
            if len(self._free) < n:
                raise OutOfBlocksError("no free seal scratch slots (more loads than configured)")
            mine, self._free = self._free[:n], self._free[n:]
        handles: list[TransferHandle | None] = []
        check = SealCheck(self, lease_id, want, mine, handles)
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
        except BaseException:
            check.close()
            raise
        return check

    def _give_back(self, slots: list[BlockId]) -> None:
        with self._lock:
            self._free.extend(slots)

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


class SealCheck:
    """Seal READs in flight (:meth:`SealReader.post`): :meth:`poll` never blocks, :meth:`wait`
    does; :meth:`close` releases them and the scratch slots (idempotent)."""

    def __init__(
        self,
        reader: SealReader,
        lease_id: str,
        want: bytes,
        slots: list[BlockId],
        handles: list[TransferHandle | None],
    ) -> None:
        self._reader = reader
        self._lease = lease_id
        self._want = want
        self._slots: list[BlockId] | None = slots
        self._handles = handles

    def poll(self) -> list[bool] | None:
        """Each owner's seal held (in link order) once every READ is over; None before."""
        for handle in self._handles:
            if handle is not None and handle.poll() == "pending":
                return None
        return self._held()

    def wait(self, timeout_s: float) -> list[bool]:
        """:meth:`poll`, waiting for the READs (each under ``timeout_s``)."""
        for handle in self._handles:
            if handle is not None:
                with contextlib.suppress(KVBridgeError):  # _held reports it
                    handle.wait(timeout_s)
        return self._held()

    def _held(self) -> list[bool]:
        assert self._slots is not None, "a closed seal check"
        held = []
        for i, handle in enumerate(self._handles):
            if handle is None or handle.poll() != "done":
                if handle is not None:  # one not posted was logged by post
                    error = getattr(handle, "error", None)
                    log.info("reading the seal of lease %s failed (%s)", self._lease, error)
                held.append(False)
                continue
            slots = self._slots[i * PROBES : (i + 1) * PROBES]
            rows = self._reader._slots
            held.append(any(rows[s].numpy().tobytes() == self._want for s in slots))
        return held

    def close(self) -> None:
        for handle in self._handles:
            if handle is not None:
                handle.release()
        if self._slots is not None:
            slots, self._slots = self._slots, None
            self._reader._give_back(slots)

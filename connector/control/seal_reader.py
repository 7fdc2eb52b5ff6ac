"""Decode's side of lease seals: READ a lease's probe slots from its owner and judge them.

:class:`SealReader` owns the reader's scratch slots (registered memory the seal READs
land in); :meth:`SealReader.holds` reads and judges one owner's seal (waiting),
:meth:`SealReader.post` only posts the READs and returns a :class:`SealCheck` to poll,
for a load driven by non-blocking polls from the engine's thread. The protocol and its
proof: :mod:`kvbridge.connector.control.seal`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.control.releases import release_message
from kvbridge.connector.control.seal import (
    PROBES,
    RANKS_AT_ONCE,
    SEAL_GROUP,
    SEAL_POLL_S,
    SEALED_BYTES,
    TAG_BYTES,
    expected_seal,
    probe_slots,
    seal_layout,
    slot_rows,
)
from kvbridge.proto.errors import KVBridgeError, OutOfBlocksError
from kvbridge.proto.types import BlockId

if TYPE_CHECKING:
    from kvbridge.connector.transport.base import PeerLink, TransferHandle, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["SealCheck", "SealReader"]

log = logging.getLogger(__name__)


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
        check = self.post(links, lease_id, digest, timeout_s)
        if check is None:
            return [False] * len(links)
        try:
            if meanwhile is not None:
                meanwhile()
            want_tag = None if tag is None else tag()
            check.wait(timeout_s)
            held, gone = check.verdict(want_tag, tagged=tag is not None)
            if absent is not None:
                absent.extend(gone)
            return held
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

    def poll(self) -> bool:
        """Whether every seal READ is over (then :meth:`verdict` says what they found)."""
        return all(h is None or h.poll() != "pending" for h in self._handles)

    def wait(self, timeout_s: float) -> None:
        """Wait for every seal READ (each under ``timeout_s``)."""
        for handle in self._handles:
            if handle is not None:
                with contextlib.suppress(KVBridgeError):  # verdict logs it
                    handle.wait(timeout_s)

    def verdict(
        self, tag: bytes | None = None, *, tagged: bool = False
    ) -> tuple[list[bool], list[bool]]:
        """``(held, absent)`` per owner, once the READs are over: ``held`` if a probe slot
        holds the lease's nonce and seal digest and, when ``tagged``, exactly the content
        ``tag`` (None when ``tagged``: no tag could be made, nothing holds); ``absent`` if
        no probe slot holds the lease's nonce at all (the owner may not have sealed it yet)."""
        assert self._slots is not None, "a closed seal check"
        no_tag = tagged and (tag is None or len(tag) != TAG_BYTES)
        want = self._want[:SEALED_BYTES] + ((tag or b"") if tagged else b"")
        held, absent = [], []
        for i, handle in enumerate(self._handles):
            if handle is None or handle.poll() != "done":
                if handle is not None:  # one not posted was logged by post
                    error = getattr(handle, "error", None)
                    log.info("reading the seal of lease %s failed (%s)", self._lease, error)
                held.append(False)
                absent.append(False)
                continue
            rows = self._reader._slots
            got = [rows[s].numpy().tobytes() for s in self._slots[i * PROBES : (i + 1) * PROBES]]
            held.append(not no_tag and any(slot[: len(want)] == want for slot in got))
            absent.append(all(slot[:16] != want[:16] for slot in got))
        return held, absent

    def close(self) -> None:
        for handle in self._handles:
            if handle is not None:
                handle.release()
        if self._slots is not None:
            slots, self._slots = self._slots, None
            self._reader._give_back(slots)

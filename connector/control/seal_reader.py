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

RELEASE_DEFER_S = 0.02
"""How long a deferred release (:meth:`SealReader.defer_release`) may wait for the loads
in flight to finish."""
FLUSH_SLOTS = 16
"""Scratch slots beyond the seal checks' for the flush READs of :meth:`SealReader.release`
(one per link at a time, at most this many at once)."""


class SealReader:
    """Decode's side: scratch slots and seal checks; thread-safe (loads run in a pool)."""

    def __init__(
        self, transport: Transport, max_concurrent: int, flush_timeout_s: float = 30.0
    ) -> None:
        self.transport = transport
        self._flush_timeout_s = flush_timeout_s
        layout = seal_layout(PROBES * RANKS_AT_ONCE * max(1, max_concurrent) + FLUSH_SLOTS)
        self._caches = layout.allocate("cpu")
        (tensor,) = self._caches.values()
        self._slots = slot_rows(tensor, layout.groups[0].num_blocks)
        self.memory = transport.register(layout, self._caches)
        self._free = [BlockId(i) for i in range(layout.groups[0].num_blocks)]
        self._lock = threading.Lock()
        self._flushes: dict[int, tuple[TransferHandle, BlockId]] = {}
        """The flush READ in flight after a release notification, per link (:meth:`release`)."""
        self._deferred: list[tuple[PeerLink, str, int, int]] = []
        self._deferred_since = 0.0

    def defer_release(
        self, link: PeerLink, lease_id: str, reader: int = 0, readers: int = 1
    ) -> None:
        """:meth:`release`, sent by a later :meth:`send_deferred`: after the load was reported,
        off its timed path."""
        with self._lock:
            if not self._deferred:
                self._deferred_since = time.monotonic()
            self._deferred.append((link, lease_id, reader, readers))

    def send_deferred(self, *, loads_in_flight: bool = False) -> None:
        """Send the deferred releases; held back while ``loads_in_flight`` (up to
        :data:`RELEASE_DEFER_S`): a notification makes the next transfer on its endpoint
        wait for the owner's progress (UCX's flush after an active message), which would
        delay those loads' seal READs."""
        with self._lock:
            if not self._deferred or (
                loads_in_flight and time.monotonic() - self._deferred_since < RELEASE_DEFER_S
            ):
                return
            deferred, self._deferred = self._deferred, []
        for link, lease_id, reader, readers in deferred:
            self.release(link, lease_id, reader, readers)

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
        expected seal (:meth:`holds_all` for one owner). Any failure is False (the caller
        takes the slow path)."""
        return self.holds_all([link], lease_id, digest, timeout_s, meanwhile, tag, wait_s)[0]

    def holds_all(
        self,
        links: Sequence[PeerLink],
        lease_id: str,
        digest: bytes,
        timeout_s: float,
        meanwhile: Callable[[], object] | None = None,
        tag: Callable[[], bytes | None] | None = None,
        wait_s: float = 0.0,
    ) -> list[bool]:
        """Whether the lease's seal holds at each owner (the TP ranks of one engine), every
        seal READ posted before the first is waited for (at most :data:`RANKS_AT_ONCE` at a
        time); waits. ``meanwhile`` runs while the seal READs are in flight (it must not
        raise). ``tag``: the content tag the slot must also hold (one owner's: one link),
        asked for after ``meanwhile`` (None from it: no tag can be made, the seal does not
        hold); without it the slot's tag bytes are not compared. ``wait_s``: an owner none of
        whose probe slots holds the lease's nonce yet is READ again, every
        :data:`SEAL_POLL_S`, for up to this long (:meth:`SealCheck.settle`)."""
        if tag is not None and len(links) != 1:
            raise ValueError("a content tag is one owner's: check it over one link")
        if len(links) > RANKS_AT_ONCE:
            head = self.holds_all(
                links[:RANKS_AT_ONCE], lease_id, digest, timeout_s, meanwhile, wait_s=wait_s
            )
            rest = links[RANKS_AT_ONCE:]
            return head + self.holds_all(rest, lease_id, digest, timeout_s, wait_s=wait_s)
        check = self.post(links, lease_id, digest, timeout_s, wait_s)
        if check is None:
            return [False] * len(links)
        try:
            if meanwhile is not None:
                meanwhile()
            want_tag = None if tag is None else tag()
            while True:
                check.wait(timeout_s)
                held = check.settle(want_tag, tagged=tag is not None)
                if held is not None:
                    return held
                time.sleep(SEAL_POLL_S)
                check.again()
        finally:
            check.close()

    def post(
        self,
        links: Sequence[PeerLink],
        lease_id: str,
        digest: bytes,
        timeout_s: float,
        wait_s: float = 0.0,
    ) -> SealCheck | None:
        """Post the seal READs of :meth:`holds_all` (at most :data:`RANKS_AT_ONCE` links) and
        return at once: the caller polls the :class:`SealCheck` (never blocks) or waits for
        it, then settles it (reading again, for up to ``wait_s``, an owner that has not
        sealed the lease yet). None: ``lease_id`` is no lease id (no seal can hold)."""
        if len(links) > RANKS_AT_ONCE:
            raise OutOfBlocksError(f"more than {RANKS_AT_ONCE} seals at once")
        self._reap()
        try:
            want = expected_seal(lease_id, digest)
        except ValueError:
            return None
        n = PROBES * len(links)
        with self._lock:
            if len(self._free) < n:
                raise OutOfBlocksError("no free seal scratch slots (more loads than configured)")
            mine, self._free = self._free[:n], self._free[n:]
        check = SealCheck(self, lease_id, want, mine, links, timeout_s, time.monotonic() + wait_s)
        try:
            check.again()
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
        ``reader`` of ``readers`` when several ranks read it (:func:`release_message`).

        Then a one-slot READ is posted on the link and left in flight (:meth:`_flush`): with
        NIXL over UCX, every transfer ends with a flush of its endpoint, and the first flush
        after a notification on that endpoint (its active-message lane, TCP on one host)
        waits for the owner to progress and answer; this READ takes that wait off the next
        load's block READ, which is then done inside its post again."""
        self._reap()
        try:
            self.transport.send_notification(link, release_message(lease_id, reader, readers))
        except KVBridgeError as exc:
            log.info("release notification for lease %s failed (%s); it will expire", lease_id, exc)
            return
        self._flush(link)

    def _flush(self, link: PeerLink) -> None:
        """Post the flush READ of :meth:`release` (one of the owner's seal slots into a
        scratch slot of ours; nothing reads it), unless one is in flight on ``link`` already
        or no scratch slot is free: it only saves time, it never decides anything."""
        with self._lock:
            busy = link.link_id in self._flushes or len(self._flushes) >= FLUSH_SLOTS
            if busy or not self._free:
                return
            mine = self._free.pop()
        try:
            handle = self.transport.read_blocks(
                link, SEAL_GROUP, [mine], [BlockId(0)], timeout_s=self._flush_timeout_s
            )
        except KVBridgeError as exc:
            log.debug("flush READ not posted (%s)", exc)
            self._give_back([mine])
            return
        with self._lock:
            self._flushes[link.link_id] = (handle, mine)

    def _reap(self) -> None:
        """Release the flush READs that are over (polling each once, never waiting)."""
        with self._lock:
            pending = list(self._flushes.items())
        for key, (handle, slot) in pending:
            if handle.poll() == "pending":
                continue
            handle.release()
            with self._lock:
                self._flushes.pop(key, None)
                self._free.append(slot)

    def close(self) -> None:
        with self._lock:
            flushes, self._flushes = list(self._flushes.values()), {}
        for handle, _ in flushes:  # the links are down or closing: in flight is given up
            handle.release()
        self.transport.unregister(self.memory)


class SealCheck:
    """One load's seal READs at its owners (:meth:`SealReader.post`), in rounds: :meth:`poll`
    never blocks, :meth:`wait` does; :meth:`settle` judges a round that is over, and an
    owner whose probe slots do not hold the lease's nonce yet is READ again by
    :meth:`again` (into the same scratch slots) until the check's wait is over;
    :meth:`close` releases the READs and the scratch slots (idempotent)."""

    def __init__(
        self,
        reader: SealReader,
        lease_id: str,
        want: bytes,
        slots: list[BlockId],
        links: Sequence[PeerLink],
        timeout_s: float,
        until: float,
    ) -> None:
        self._reader = reader
        self._lease = lease_id
        self._want = want
        self._slots: list[BlockId] | None = slots
        self._links = list(links)
        self._timeout_s = timeout_s
        self._until = until
        """Until when (``time.monotonic()``) an owner that has not sealed the lease yet is
        READ again."""
        self._handles: list[TransferHandle | None] = [None] * len(self._links)
        self._settled: list[bool | None] = [None] * len(self._links)
        """Each owner's answer once settled (held or not); None: to be READ (again)."""
        self.rounds = 0
        """Rounds of READs posted so far."""

    def again(self) -> None:
        """Post the READ of every owner not settled yet (the first round: every owner); a
        READ that cannot be posted settles its owner as not holding (logged)."""
        assert self._slots is not None, "a closed seal check"
        transport = self._reader.transport
        for i, link in enumerate(self._links):
            if self._settled[i] is not None:
                continue
            old, self._handles[i] = self._handles[i], None
            if old is not None:
                old.release()
            remote = probe_slots(self._lease, link.remote_layout.groups[0].num_blocks)
            slots = self._slots[i * PROBES : (i + 1) * PROBES]
            try:
                self._handles[i] = transport.read_blocks(
                    link, SEAL_GROUP, slots, remote, timeout_s=self._timeout_s
                )
            except KVBridgeError as exc:
                log.info("reading the seal of lease %s failed (%s)", self._lease, exc)
                self._settled[i] = False
        self.rounds += 1

    def _open(self) -> list[TransferHandle]:
        return [h for h, s in zip(self._handles, self._settled, strict=True) if h and s is None]

    def poll(self) -> bool:
        """Whether this round's seal READs are over (then :meth:`settle` judges them)."""
        return all(h.poll() != "pending" for h in self._open())

    def wait(self, timeout_s: float) -> None:
        """Wait for this round's seal READs (each under ``timeout_s``)."""
        for handle in self._open():
            with contextlib.suppress(KVBridgeError):  # verdict logs it
                handle.wait(timeout_s)

    def settle(self, tag: bytes | None = None, *, tagged: bool = False) -> list[bool] | None:
        """Judge the round that is over (:meth:`verdict`): an owner whose seal held, or
        whose slots hold the lease's nonce with another seal or tag, or whose READ failed,
        is settled; one whose slots do not hold the nonce at all (it may not have sealed
        the lease yet: vLLM's worker makes a lease a step after its id was handed out) is
        settled as not holding once the wait is over. Each owner's answer once all are
        settled; None while one is still to be READ again (:meth:`again`)."""
        held, absent = self.verdict(tag, tagged=tagged)
        late = time.monotonic() < self._until
        for i, settled in enumerate(self._settled):
            if settled is None and (held[i] or not absent[i] or not late):
                self._settled[i] = held[i]
        if any(s is None for s in self._settled):
            return None
        return [bool(s) for s in self._settled]

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
                if handle is not None:  # one not posted was logged by again
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

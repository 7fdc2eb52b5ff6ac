"""Leases: blocks pinned for a peer until it releases them or stops heartbeating.

A peer reads our KV blocks only while we keep them pinned (fail closed: a
block that may have been reused is never read). A :class:`Lease` names such a pin;
the :class:`LeaseTable` holds them, and its one promise is that every lease's blocks are unpinned
**exactly once** — on release, on expiry, or when the table is closed. An
expired lease only makes its blocks *evictable* (the owner drops its
reference); memory another pin still covers stays referenced.

The table calls the :class:`BlockOwner` — whoever owns the KV memory — to
unpin. The control server's threads call both, so both are thread-safe.

A lease may name the *peer* it was created for (the control server passes the
caller's authenticated identity, :func:`~kvbridge.connector.control.auth.caller_identity`);
:meth:`LeaseTable.create` then enforces per-peer caps on leases and pinned
blocks, so one peer cannot pin the whole pool. A lease the owner made for a
hand-over names no peer until the first peer that pins it by request id claims
it (:meth:`LeaseTable.heartbeat` with ``claim=True``): from then on it is
charged to that peer and only that peer may extend it. Extensions by a peer
(a :class:`Claimant`) never reach past ``max_lifetime_s`` after the lease was
created. Released and expired leases give their memory back: per-peer counters
drop to nothing and the deadline heap is compacted when stale entries
outnumber live leases.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from kvbridge.connector.control.block_owner import BlockOwner, GroupBlocks, GroupHashes
from kvbridge.connector.control.bounds import (
    Claimant,
    PeerCaps,
    PeerUse,
    block_keys,
    check_ttl,
)
from kvbridge.connector.control.seal import SealTable, content_tag, seal_digest
from kvbridge.connector.control.types import HandOverDigests
from kvbridge.proto.errors import ConfigError, ControlPlaneError, LeaseError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = [
    "BlockOwner",
    "Claimant",
    "GroupBlocks",
    "GroupHashes",
    "HandOverDigests",
    "Lease",
    "LeaseTable",
    "PeerCaps",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks pinned for a peer until ``expires_at`` (on the table's clock)."""

    lease_id: LeaseId
    expires_at: float
    blocks: Mapping[KVGroup, tuple[BlockId, ...]]
    hashes: Mapping[KVGroup, tuple[BlockHash, ...]] = field(default_factory=dict)
    request_id: RequestId | None = None
    peer: str | None = None
    """Who holds the pin (per-peer caps): the peer that asked for it, or the one that
    claimed an owner-made hand-over; None for a hand-over nobody claimed yet."""
    created_at: float = 0.0
    """When the lease was made (table clock): extensions stop at ``created_at`` plus the
    claimant's ``max_lifetime_s``."""

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.blocks.values())


def new_lease_id() -> LeaseId:
    """128 random bits as 32 lowercase hex digits (the only format the server accepts)."""
    return LeaseId(secrets.token_hex(16))


class LeaseTable:
    """Thread-safe set of live leases; unpins each lease's blocks exactly once.

    ``clock`` returns seconds (monotonic); tests inject a fake one. Expiry is
    enforced by :meth:`expire`, which the control server calls from a reaper
    thread and at the start of every call.
    """

    def __init__(
        self,
        owner: BlockOwner,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_leases: int = 1 << 16,
        seal: SealTable | None = None,
    ) -> None:
        if max_leases < 1:
            raise ConfigError(f"max_leases must be >= 1, got {max_leases}")
        self._owner = owner
        self._clock = clock
        self._max_leases = max_leases
        self._lock = threading.Condition(threading.Lock())
        """Guards the table; notified when a lease is created (:meth:`digests` waits)."""
        self._leases: dict[LeaseId, Lease] = {}
        self._by_request: dict[RequestId, LeaseId] = {}
        self._deadlines: list[tuple[float, LeaseId]] = []  # heap; stale entries are skipped
        self.seal = seal
        """Where each lease's seal is published while it is held (see :mod:`.seal`)."""
        self._sealed: set[LeaseId] = set()
        self._digests: dict[LeaseId, HandOverDigests] = {}
        self._per_peer: dict[str, PeerUse] = {}

    @property
    def owner(self) -> BlockOwner:
        return self._owner

    def now(self) -> float:
        return self._clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def has_room(self) -> bool:
        with self._lock:
            return len(self._leases) < self._max_leases

    def create(
        self,
        blocks: GroupBlocks,
        *,
        ttl_s: float,
        hashes: GroupHashes | None = None,
        request_id: RequestId | None = None,
        lease_id: LeaseId | None = None,
        digests: HandOverDigests | None = None,
        seal_key: int | None = None,
        peer: str | None = None,
        caps: PeerCaps | None = None,
    ) -> Lease:
        """Put already-pinned ``blocks`` under a new lease; the table now owns the pin.

        ``lease_id`` is the id the caller already handed out (vLLM's scheduler puts it
        into kv_transfer_params before the worker makes the lease); default a new one.
        ``digests`` are the blocks' hand-over digests, answered by :meth:`digests` while
        the lease lives. With a seal table, the lease's seal over ``blocks`` and
        ``hashes`` is published under the lease id until the lease ends; with ``digests``
        and the hand-over's ``seal_key`` too, the seal carries their content tag
        (:func:`~kvbridge.connector.control.seal.content_tag`). With ``peer``
        and ``caps``, the lease counts against that peer's caps.

        If this raises (table full, peer over its caps, request or id already leased)
        the caller still owns the pin and must unpin.
        """
        check_ttl(ttl_s)
        now = self._clock()
        lease = Lease(
            lease_id=lease_id or new_lease_id(),
            expires_at=now + ttl_s,
            created_at=now,
            blocks={g: tuple(ids) for g, ids in blocks.items()},
            hashes={g: tuple(h) for g, h in (hashes or {}).items()},
            request_id=request_id,
            peer=peer,
        )
        with self._lock:
            if len(self._leases) >= self._max_leases:
                raise ControlPlaneError(
                    f"{len(self._leases)} leases are held, the limit is {self._max_leases}; "
                    "release leases or raise max_leases",
                    code="RESOURCE_EXHAUSTED",
                )
            if request_id is not None and request_id in self._by_request:
                raise LeaseError(f"request {request_id!r} already has a lease")
            if lease.lease_id in self._leases:
                raise LeaseError(f"lease id {lease.lease_id!r} is already in use")
            if peer is not None:
                self._charge(peer, lease, caps)
            self._leases[lease.lease_id] = lease
            if request_id is not None:
                self._by_request[request_id] = lease.lease_id
            heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id))
            if digests is not None:
                self._digests[lease.lease_id] = digests
            sealed = self.seal is not None and self._publish(lease, digests, seal_key)
            if sealed:
                self._sealed.add(lease.lease_id)
            self._lock.notify_all()
        log.debug("lease %s: %d blocks, ttl %.3gs", lease.lease_id, lease.num_blocks, ttl_s)
        return lease

    def _publish(self, lease: Lease, digests: HandOverDigests | None, seal_key: int | None) -> bool:
        """Write ``lease``'s seal, tagged with its blocks' digests where there are some."""
        assert self.seal is not None
        digest = seal_digest(lease.blocks, lease.hashes)
        tag = b""
        if digests is not None and seal_key is not None:
            tag = content_tag(lease.lease_id, digest, seal_key, digests.algo, digests.groups)
        return self.seal.publish(lease.lease_id, digest, tag)

    def get(self, lease_id: LeaseId) -> Lease | None:
        self.expire()
        with self._lock:
            return self._leases.get(lease_id)

    def get_by_request(self, request_id: RequestId) -> Lease | None:
        self.expire()
        with self._lock:
            lease_id = self._by_request.get(request_id)
            return None if lease_id is None else self._leases.get(lease_id)

    def heartbeat(
        self,
        lease_ids: Iterable[LeaseId],
        ttl_s: float,
        by: Claimant | None = None,
        *,
        claim: bool = False,
    ) -> list[Lease]:
        """Extend the live ones among ``lease_ids`` to at least ``now + ttl_s``; returns them.

        ``by`` None is the owner itself: any lease is extended. A peer (``by``) extends
        only the leases charged to it, and never past ``created_at + by.max_lifetime_s``;
        the others are left alone and not returned. With ``claim``, an owner-made lease
        nobody holds yet is first charged to ``by`` (ControlPlaneError
        ``RESOURCE_EXHAUSTED`` if that exceeds its caps; nothing changes then).
        """
        check_ttl(ttl_s)
        self.expire()
        alive = []
        with self._lock:
            now = self._clock()
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is None:
                    continue
                until = now + ttl_s
                if by is not None:
                    if lease.peer is None and claim:
                        lease = replace(lease, peer=by.peer)
                        self._charge(by.peer, lease, by.caps)
                        self._leases[lease_id] = lease
                    if lease.peer != by.peer:
                        continue
                    until = min(until, lease.created_at + by.max_lifetime_s)
                if until > lease.expires_at:
                    lease = replace(lease, expires_at=until)
                    self._leases[lease_id] = lease
                    heapq.heappush(self._deadlines, (until, lease_id))
                alive.append(lease)
            self._compact()
        return alive

    def release(self, lease_id: LeaseId) -> bool:
        """Unpin a lease's blocks; False (and nothing happens) if it is unknown or gone."""
        self.expire()
        with self._lock:
            lease = self._pop(lease_id)
            self._compact()
        if lease is None:
            return False
        self._unpin(lease, "released")
        return True

    def expire(self, now: float | None = None) -> int:
        """Unpin every lease whose expiry is ``<= now``; returns how many."""
        expired = []
        with self._lock:
            now = self._clock() if now is None else now
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.get(lease_id)
                if lease is not None and lease.expires_at == deadline:
                    self._pop(lease_id)
                    expired.append(lease)
        for lease in expired:
            self._unpin(lease, "expired")
        return len(expired)

    def release_all(self) -> int:
        """Unpin every lease (the server is closing); returns how many."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
            self._by_request.clear()
            self._deadlines.clear()
            self._digests.clear()
            self._per_peer.clear()
        for lease in leases:
            self._unpin(lease, "released at shutdown")
        return len(leases)

    def peer_usage(self, peer: str) -> tuple[int, int]:
        """``(leases, distinct blocks)`` that ``peer`` holds now."""
        with self._lock:
            use = self._per_peer.get(peer)
            return (0, 0) if use is None else (use.leases, len(use.blocks))

    def footprint(self) -> int:
        """Entries the table keeps (leases, deadlines, per-peer counters): stays
        proportional to the live leases, however many came and went."""
        with self._lock:
            return (
                len(self._leases)
                + len(self._by_request)
                + len(self._deadlines)
                + len(self._digests)
                + len(self._per_peer)
            )

    def digests(self, lease_id: LeaseId, wait_s: float = 0.0) -> HandOverDigests | None:
        """The block digests recorded for live lease ``lease_id``, waiting up to ``wait_s``
        for a lease its owner has named but not yet made (vLLM's worker hears of a hand-over
        after its scheduler); None: no such lease, or none recorded with it."""
        self.expire()
        with self._lock:
            self._lock.wait_for(lambda: lease_id in self._leases, timeout=wait_s)
            return self._digests.get(lease_id)

    def next_expiry(self) -> float | None:
        """Earliest deadline on the table's clock (possibly of a stale entry), or None."""
        with self._lock:
            return self._deadlines[0][0] if self._deadlines else None

    # ------------------------------------------------------------------ helpers

    def _pop(self, lease_id: LeaseId) -> Lease | None:
        """Remove a lease from the table (lock held); the caller then unpins it once."""
        lease = self._leases.pop(lease_id, None)
        self._digests.pop(lease_id, None)
        if lease is not None and lease.request_id is not None:
            self._by_request.pop(lease.request_id, None)
        if lease is not None and lease.peer is not None:
            use = self._per_peer[lease.peer]
            use.leases -= 1
            use.blocks.subtract(block_keys(lease.blocks))
            if use.leases == 0:
                del self._per_peer[lease.peer]  # nothing kept for a peer that holds nothing
            else:
                use.blocks = +use.blocks  # drop blocks no lease of the peer holds
        return lease

    def _charge(self, peer: str, lease: Lease, caps: PeerCaps | None) -> None:
        """Count ``lease`` against ``peer`` (lock held), within ``caps``. Blocks count once
        per peer however many of its leases pin them: the cap bounds memory, not calls."""
        use = self._per_peer.get(peer) or PeerUse()
        keys = block_keys(lease.blocks)
        new = len(set(keys) - set(use.blocks))
        if caps is not None and (
            use.leases + 1 > caps.max_leases or len(use.blocks) + new > caps.max_blocks
        ):
            raise ControlPlaneError(
                f"peer {peer[:64]!r} holds {use.leases} leases over {len(use.blocks)} blocks; "
                f"{new} more would exceed its caps ({caps.max_leases} leases, "
                f"{caps.max_blocks} blocks): release leases first",
                code="RESOURCE_EXHAUSTED",
            )
        use.leases += 1
        use.blocks.update(keys)
        self._per_peer[peer] = use

    def _compact(self) -> None:
        """Drop stale deadline entries once they outnumber live leases (lock held)."""
        if len(self._deadlines) <= 2 * len(self._leases) + 64:
            return
        self._deadlines = [(x.expires_at, x.lease_id) for x in self._leases.values()]
        heapq.heapify(self._deadlines)

    def _unpin(self, lease: Lease, why: str) -> None:
        log.debug("lease %s %s: unpinning %d blocks", lease.lease_id, why, lease.num_blocks)
        if self.seal is not None:  # the seal goes before the pin: no reader trusts a reuse
            with self._lock:
                sealed = lease.lease_id in self._sealed
                self._sealed.discard(lease.lease_id)
            if sealed:
                self.seal.retract(lease.lease_id)
        try:
            self._owner.unpin(lease.blocks)
        except Exception:
            # The lease is gone either way: retrying could unpin twice.
            log.exception("lease %s %s: the block owner failed to unpin", lease.lease_id, why)

"""Leases: blocks pinned for a peer until it releases them or stops heartbeating.

A peer reads our KV blocks only while we keep them pinned (DESIGN.md §1,
"fail closed"). A :class:`Lease` names such a pin; the :class:`LeaseTable`
holds them, and its one promise is that every lease's blocks are unpinned
**exactly once** — on release, on expiry, or when the table is closed. An
expired lease only makes its blocks *evictable* (the owner drops its
reference); memory another pin still covers stays referenced.

The table calls the :class:`BlockOwner` — whoever owns the KV memory — to
unpin. The control server's threads call both, so both are thread-safe.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvbridge.connector.control.seal import SealTable, seal_digest
from kvbridge.proto.errors import ConfigError, ControlPlaneError, LeaseError
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = ["BlockOwner", "GroupBlocks", "GroupHashes", "Lease", "LeaseTable"]

log = logging.getLogger(__name__)

GroupBlocks = Mapping[str, Sequence[BlockId]]
GroupHashes = Mapping[str, Sequence[BlockHash]]


class BlockOwner(ABC):
    """The owner of a worker's KV memory, as the control plane sees it.

    Implemented by whoever owns the blocks: the engine scheduler's block
    manager or the offload daemon's host pool. Called from the control
    server's worker threads (and its lease reaper thread) concurrently with the
    owner's own work, so implementations must lock.
    """

    @abstractmethod
    def num_blocks(self, group: str) -> int:
        """Blocks in ``group`` (ids are ``0..num_blocks-1``); 0 if the group is unknown."""

    @abstractmethod
    def pin_hashes(self, group_hashes: GroupHashes) -> dict[str, list[BlockId]]:
        """Take a reference on the longest present prefix of each group's hashes.

        Returns the pinned block ids per group, in hash order (a group with no
        hit maps to ``[]``). The caller releases them with :meth:`unpin`.
        """

    @abstractmethod
    def unpin(self, blocks: GroupBlocks) -> None:
        """Drop one reference per block taken by :meth:`pin_hashes` (or by the owner itself
        when it created a lease for a finished request). Blocks whose last reference
        goes become evictable; they are not wiped."""


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks pinned for a peer until ``expires_at`` (on the table's clock)."""

    lease_id: LeaseId
    expires_at: float
    blocks: Mapping[str, tuple[BlockId, ...]]
    hashes: Mapping[str, tuple[BlockHash, ...]] = field(default_factory=dict)
    request_id: RequestId | None = None

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
        self._lock = threading.Lock()
        self._leases: dict[LeaseId, Lease] = {}
        self._by_request: dict[RequestId, LeaseId] = {}
        self._deadlines: list[tuple[float, LeaseId]] = []  # heap; stale entries are skipped
        self.seal = seal
        """Where each lease's seal is published while it is held (see :mod:`.seal`)."""
        self._sealed_as: dict[LeaseId, str] = {}

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
        seal_as: str | None = None,
    ) -> Lease:
        """Put already-pinned ``blocks`` under a new lease; the table now owns the pin.

        With a seal table, the lease's seal over ``blocks`` and ``hashes`` is
        published under ``seal_as`` (the id the reader knows the lease by;
        default the lease id) until the lease ends.

        If this raises (table full, request already leased) the caller still
        owns the pin and must unpin.
        """
        if ttl_s <= 0:
            raise ConfigError(f"lease ttl_s must be > 0, got {ttl_s}")
        lease = Lease(
            lease_id=new_lease_id(),
            expires_at=self._clock() + ttl_s,
            blocks={g: tuple(ids) for g, ids in blocks.items()},
            hashes={g: tuple(h) for g, h in (hashes or {}).items()},
            request_id=request_id,
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
            self._leases[lease.lease_id] = lease
            if request_id is not None:
                self._by_request[request_id] = lease.lease_id
            heapq.heappush(self._deadlines, (lease.expires_at, lease.lease_id))
            if self.seal is not None:
                key = seal_as or lease.lease_id
                if self.seal.publish(key, seal_digest(lease.blocks, lease.hashes)):
                    self._sealed_as[lease.lease_id] = key
        log.debug("lease %s: %d blocks, ttl %.3gs", lease.lease_id, lease.num_blocks, ttl_s)
        return lease

    def get(self, lease_id: LeaseId) -> Lease | None:
        self.expire()
        with self._lock:
            return self._leases.get(lease_id)

    def get_by_request(self, request_id: RequestId) -> Lease | None:
        self.expire()
        with self._lock:
            lease_id = self._by_request.get(request_id)
            return None if lease_id is None else self._leases.get(lease_id)

    def heartbeat(self, lease_ids: Iterable[LeaseId], ttl_s: float) -> list[Lease]:
        """Extend the live ones among ``lease_ids`` to at least ``now + ttl_s``; returns them."""
        self.expire()
        alive = []
        with self._lock:
            until = self._clock() + ttl_s
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is None:
                    continue
                if until > lease.expires_at:
                    lease = replace(lease, expires_at=until)
                    self._leases[lease_id] = lease
                    heapq.heappush(self._deadlines, (until, lease_id))
                alive.append(lease)
        return alive

    def release(self, lease_id: LeaseId) -> bool:
        """Unpin a lease's blocks; False (and nothing happens) if it is unknown or gone."""
        self.expire()
        with self._lock:
            lease = self._pop(lease_id)
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
        for lease in leases:
            self._unpin(lease, "released at shutdown")
        return len(leases)

    def next_expiry(self) -> float | None:
        """Earliest deadline on the table's clock (possibly of a stale entry), or None."""
        with self._lock:
            return self._deadlines[0][0] if self._deadlines else None

    # ------------------------------------------------------------------ helpers

    def _pop(self, lease_id: LeaseId) -> Lease | None:
        """Remove a lease from the table (lock held); the caller then unpins it once."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.request_id is not None:
            self._by_request.pop(lease.request_id, None)
        return lease

    def _unpin(self, lease: Lease, why: str) -> None:
        log.debug("lease %s %s: unpinning %d blocks", lease.lease_id, why, lease.num_blocks)
        if self.seal is not None:  # the seal goes before the pin: no reader trusts a reuse
            with self._lock:
                key = self._sealed_as.pop(lease.lease_id, None)
            if key is not None:
                self.seal.retract(key)
        try:
            self._owner.unpin(lease.blocks)
        except Exception:
            # The lease is gone either way: retrying could unpin twice.
            log.exception("lease %s %s: the block owner failed to unpin", lease.lease_id, why)

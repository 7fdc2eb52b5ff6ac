"""What holds a finished prefill request's blocks in a vLLM worker, as the control plane sees it.

:class:`HeldRequests` is the block owner behind the worker's lease table: the blocks vLLM
keeps (``delay_free``) for finished requests. :class:`NamedLeases` is that lease table,
answering to the lease ids the scheduler chose and keeping, with each lease, the block
digests the worker recorded at hand-over (in this process's memory, never in NIXL-registered
memory; decode asks for them with ``Digests``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbridge.connector.control.leases import (
    BlockOwner,
    Claimant,
    HandOverDigests,
    Lease,
    LeaseTable,
)
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

if TYPE_CHECKING:
    from kvbridge.connector.control.seal import SealTable
    from kvbridge.connector.vllm.scheduler import HoldOrder

__all__ = ["HeldRequests", "NamedLeases"]

log = logging.getLogger(__name__)


class HeldRequests(BlockOwner):
    """The KV memory as the control plane sees it: blocks vLLM holds for finished requests.

    Thread-safe (the control server's threads and the lease reaper call
    :meth:`unpin`). A request is *done* once its lease is gone; vLLM then frees
    its blocks, which may be reused at once, so :meth:`pin_hashes` never pins
    anything: a decode that lost its lease recomputes.
    """

    def __init__(self) -> None:
        self.blocks_per_group: dict[str, int] = {}
        self._lock = threading.Lock()
        self._held: dict[tuple[BlockId, ...], list[RequestId]] = {}
        self._done: set[RequestId] = set()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def hold(self, request_id: RequestId, block_ids: Sequence[BlockId]) -> None:
        with self._lock:
            self._held.setdefault(tuple(block_ids), []).append(request_id)

    def release(self, request_id: RequestId) -> None:
        """Give a request back to vLLM without a lease (it could not be leased)."""
        with self._lock:
            for key, rids in list(self._held.items()):
                if request_id in rids:
                    rids.remove(request_id)
                    if not rids:
                        del self._held[key]
            self._done.add(request_id)

    def take_done(self) -> set[RequestId]:
        with self._lock:
            done, self._done = self._done, set()
        return done

    # ----- BlockOwner ----------------------------------------------------------------------
    def num_blocks(self, group: KVGroup) -> int:
        return self.blocks_per_group.get(group, 0)

    def pin_hashes(
        self, group_hashes: Mapping[KVGroup, Sequence[BlockHash]]
    ) -> dict[KVGroup, list[BlockId]]:
        return {g: [] for g in group_hashes}

    def unpin(self, blocks: Mapping[KVGroup, Sequence[BlockId]]) -> None:
        key = tuple(blocks.get(KVGroup.SELF, ()))
        with self._lock:
            rids = self._held.get(key)
            if not rids:
                log.warning("unpin of %d blocks that no request holds", len(key))
                return
            rid = rids.pop(0)
            if not rids:
                del self._held[key]
            self._done.add(rid)


class NamedLeases(LeaseTable):
    """A lease table whose leases for finished requests also answer to the id the scheduler
    chose (decode peers heartbeat and release by that id)."""

    def __init__(self, held: HeldRequests, seal: SealTable | None = None) -> None:
        super().__init__(held, seal=seal)
        self._names: dict[LeaseId, LeaseId] = {}
        self._name_of: dict[RequestId, LeaseId] = {}
        self._digests: dict[LeaseId, HandOverDigests] = {}
        """By the scheduler's lease id: what the worker digested at hand-over."""
        self._names_lock = threading.Condition()

    def create_named(self, order: HoldOrder, digests: HandOverDigests | None = None) -> Lease:
        lease = self.create(
            order.blocks(),
            ttl_s=order.ttl_s,
            hashes=order.hashes(),
            request_id=order.request_id,
            seal_as=order.lease_id,
        )
        with self._names_lock:
            self._names[order.lease_id] = lease.lease_id
            self._name_of[order.request_id] = order.lease_id
            if digests is not None:
                self._digests[order.lease_id] = digests
            self._names_lock.notify_all()
        return lease

    def digests(self, lease_id: LeaseId, wait_s: float = 0.0) -> HandOverDigests | None:
        """What the worker digested for the lease the scheduler named ``lease_id``; waits up
        to ``wait_s`` for a hold order that has not reached the worker yet."""
        with self._names_lock:
            self._names_lock.wait_for(lambda: lease_id in self._names, timeout=wait_s)
            return self._digests.get(lease_id)

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        with self._names_lock:
            for rid in request_ids:
                name = self._name_of.pop(rid, None)
                if name is not None:
                    self._names.pop(name, None)
                    self._digests.pop(name, None)

    def _real(self, lease_id: LeaseId) -> LeaseId:
        with self._names_lock:
            return self._names.get(lease_id, lease_id)

    def get(self, lease_id: LeaseId) -> Lease | None:
        return super().get(self._real(lease_id))

    def heartbeat(
        self,
        lease_ids: Iterable[LeaseId],
        ttl_s: float,
        by: Claimant | None = None,
        *,
        claim: bool = False,
    ) -> list[Lease]:
        """Extends the leases; each comes back under the id it was asked by."""
        asked = {self._real(x): x for x in lease_ids}
        alive = super().heartbeat(list(asked), ttl_s, by, claim=claim)
        return [replace(lease, lease_id=asked[lease.lease_id]) for lease in alive]

    def release(self, lease_id: LeaseId) -> bool:
        return super().release(self._real(lease_id))

"""The reference engine's KV memory as the control plane and the planner see it.

:class:`EngineBlockOwner` is the :class:`~kvbridge.connector.control.leases.BlockOwner`
of a serving engine: the engine side's lease table
(:class:`~kvbridge.connector.engine_side.EngineSide`) is built over it.
:class:`EngineLeaseIssuer` is its :class:`~kvbridge.connector.handover.LeaseIssuer`,
putting finished prefill requests under leases in that table. Leases hold references
of their own on the engine's pool blocks (``touch`` to pin, ``free`` to unpin), so a
finished prefill request's blocks stay put while decode reads them, and become
evictable — not wiped — when the lease is released or expires. Called from the
scheduler thread and from the control server's threads; every pool operation holds
the engine's lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvbridge.connector.control.leases import BlockOwner, GroupBlocks, GroupHashes, LeaseTable
from kvbridge.connector.handover import LeaseIssuer
from kvbridge.kernels import block_digests, digest_algo
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId
from kvbridge.worker.engine import Engine

__all__ = ["EngineBlockOwner", "EngineLeaseIssuer"]


class EngineBlockOwner(BlockOwner):
    """Pins and unpins blocks in ``engine``'s pools."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def num_blocks(self, group: KVGroup) -> int:
        pool = self._engine.pools.get(group)
        return 0 if pool is None else pool.num_blocks

    def pin_hashes(
        self, group_hashes: Mapping[KVGroup, Sequence[BlockHash]]
    ) -> dict[KVGroup, list[BlockId]]:
        out: dict[KVGroup, list[BlockId]] = {}
        with self._engine.lock:
            for group, hashes in group_hashes.items():
                pool = self._engine.pools.get(group)
                ids = [] if pool is None else pool.lookup_prefix(hashes)
                if ids:
                    assert pool is not None
                    pool.touch(ids)
                out[group] = ids
        return out

    def unpin(self, blocks: Mapping[KVGroup, Sequence[BlockId]]) -> None:
        with self._engine.lock:
            for group, ids in blocks.items():
                self._engine.pools[group].free(ids)


class EngineLeaseIssuer(LeaseIssuer):
    """Leases ``engine``'s finished prefill requests in ``leases`` (whose owner pins them)."""

    def __init__(self, engine: Engine, leases: LeaseTable, lease_ttl_s: float) -> None:
        self._engine = engine
        self._leases = leases
        self._ttl_s = lease_ttl_s

    def verified_prefix(
        self, group: KVGroup, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> int:
        pool = self._engine.pools.get(group)
        if pool is None:
            return 0
        n = 0
        with self._engine.lock:
            for block_id, block_hash in zip(block_ids, hashes, strict=False):
                if pool.block_hash(block_id) != block_hash:
                    break
                n += 1
        return n

    def lease_request(
        self, request_id: RequestId, blocks: GroupBlocks, hashes: GroupHashes
    ) -> tuple[LeaseId, float]:
        with self._engine.lock:
            for group, ids in blocks.items():
                self._engine.pools[group].touch(ids)
        try:
            lease = self._leases.create(
                blocks, ttl_s=self._ttl_s, hashes=hashes, request_id=request_id
            )
        except BaseException:
            self._leases.owner.unpin(blocks)
            raise
        return lease.lease_id, self._ttl_s

    def digest_algo(self) -> str:
        return digest_algo(self._engine.layout, KVGroup.SELF)

    def digests(self, blocks: GroupBlocks, key: int) -> dict[KVGroup, list[bytes]] | None:
        """Digested at once: the engine's KV memory lives in this process (the blocks are
        leased, so nothing writes them but a peer with their NIXL metadata)."""
        layout = self._engine.layout
        with self._engine.lock:
            return {g: block_digests(layout, g, ids, key) for g, ids in blocks.items()}

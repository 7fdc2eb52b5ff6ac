"""A :class:`~kvbridge.connector.control.leases.BlockOwner` over kvbridge's own block pools."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvbridge.connector.control.leases import BlockOwner, GroupBlocks, GroupHashes
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId
from kvbridge.worker.block_pool import BlockPool

__all__ = ["PoolBlockOwner"]


class PoolBlockOwner(BlockOwner):
    """A :class:`BlockOwner` over one :class:`BlockPool` per group, under one lock.

    The standalone ``kvbridge serve`` and the control benchmark use it; an
    engine implements :class:`BlockOwner` over its own block manager.
    """

    def __init__(self, pools: Mapping[KVGroup, BlockPool]) -> None:
        self._pools = dict(pools)
        self.lock = threading.Lock()
        """Held while the pools are used; take it to change them from another thread."""

    def pool(self, group: KVGroup) -> BlockPool:
        return self._pools[group]

    def num_blocks(self, group: KVGroup) -> int:
        pool = self._pools.get(group)
        return 0 if pool is None else pool.num_blocks

    def pin_hashes(self, group_hashes: GroupHashes) -> dict[KVGroup, list[BlockId]]:
        out: dict[KVGroup, list[BlockId]] = {}
        with self.lock:
            for group, hashes in group_hashes.items():
                pool = self._pools.get(group)
                hits = [] if pool is None else pool.lookup_prefix(hashes)
                if pool is not None:
                    pool.touch(hits)
                out[group] = hits
        return out

    def unpin(self, blocks: GroupBlocks) -> None:
        with self.lock:
            for group, ids in blocks.items():
                if ids:  # pin_hashes answers [] for a group it does not have
                    self._pools[group].free(ids)

"""The owner of a worker's KV memory, as the control plane sees it (:class:`BlockOwner`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId

__all__ = ["BlockOwner", "GroupBlocks", "GroupHashes"]

GroupBlocks = Mapping[KVGroup, Sequence[BlockId]]
GroupHashes = Mapping[KVGroup, Sequence[BlockHash]]


class BlockOwner(ABC):
    """The owner of a worker's KV memory, as the control plane sees it.

    Implemented by whoever owns the blocks: the engine scheduler's block
    manager or the offload daemon's host pool. Called from the control
    server's worker threads (and its lease reaper thread) concurrently with the
    owner's own work, so implementations must lock.
    """

    @abstractmethod
    def num_blocks(self, group: KVGroup) -> int:
        """Blocks in ``group`` (ids are ``0..num_blocks-1``); 0 if the group is unknown."""

    @abstractmethod
    def pin_hashes(self, group_hashes: GroupHashes) -> dict[KVGroup, list[BlockId]]:
        """Take a reference on the longest present prefix of each group's hashes.

        Returns the pinned block ids per group, in hash order (a group with no
        hit maps to ``[]``). The caller releases them with :meth:`unpin`.
        """

    @abstractmethod
    def unpin(self, blocks: GroupBlocks) -> None:
        """Drop one reference per block taken by :meth:`pin_hashes` (or by the owner itself
        when it created a lease for a finished request). Blocks whose last reference
        goes become evictable; they are not wiped."""

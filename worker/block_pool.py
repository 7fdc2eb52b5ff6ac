"""A fixed pool of KV-cache block ids with reference counts and a prefix-hash cache.

One :class:`BlockPool` manages the block ids of one KV-cache group; a caller with
several groups keeps a dict of pools. It backs both the reference engine's block
cache (owned by the engine scheduler) and the CPU offload daemon's host pool
(owned by the daemon's servicer, which calls it under its own lock). The pool is
pure bookkeeping: it never touches memory, NIXL or torch, and it is **not**
thread-safe. Exactly one single-threaded owner calls it.

A block is either *referenced* (ref count > 0) or *free* (ref count 0, in the
free queue). A free block keeps its hash, so a later request can take it back
with :meth:`BlockPool.touch` as a cache hit; :meth:`BlockPool.allocate` reuses
free blocks least recently freed first and evicts their hashes as it does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvbridge.connector.events import BlockEventSink
from kvbridge.proto.errors import BlockPoolError, OutOfBlocksError
from kvbridge.proto.types import BlockHash, BlockId

__all__ = ["BlockPool"]

EvictCallback = Callable[[BlockHash, BlockId], None]


class BlockPool:
    """Block ids ``0..num_blocks-1`` with ref counts, an LRU free queue and a hash map.

    The free queue is a doubly linked list kept in two int arrays (``_prev``,
    ``_next``) closed into a ring by one sentinel at index ``num_blocks``, so
    popping the head, appending at the tail and unlinking a block from the
    middle are all O(1) with no per-node objects.

    ``on_evict(hash, block_id)`` is called when :meth:`allocate` reuses a free
    block that still had a hash, after the pool's state is consistent again.
    ``events`` (KV events) hears of every hash that becomes cached or stops being cached.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        on_evict: EvictCallback | None = None,
        events: BlockEventSink | None = None,
    ) -> None:
        if num_blocks < 1:
            raise BlockPoolError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._on_evict = on_evict
        self._events = events
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, BlockId] = {}
        # Ring over ids 0..num_blocks-1 plus the sentinel; initially in id order.
        sentinel = num_blocks
        self._sentinel = sentinel
        self._next: list[int] = [*range(1, num_blocks + 1), 0]
        self._prev: list[int] = [sentinel, *range(num_blocks)]
        self._num_free = num_blocks

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks (referenced or free) registered under a hash."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks that are referenced, in ``[0, 1]``."""
        return 1.0 - self._num_free / self._num_blocks

    def ref_count(self, block_id: BlockId) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        self._check_id(block_id)
        return self._hash[block_id]

    def get_block(self, block_hash: BlockHash) -> BlockId | None:
        return self._hash_to_block.get(block_hash)

    def lookup_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks of the longest prefix of ``hashes`` that is cached; changes nothing."""
        hits: list[BlockId] = []
        for block_hash in hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def free_block_ids(self) -> list[BlockId]:
        """Free blocks in queue order, next to be allocated first (for tests and debugging)."""
        ids: list[BlockId] = []
        node = self._next[self._sentinel]
        for _ in range(self._num_free):
            ids.append(BlockId(node))
            node = self._next[node]
        assert node == self._sentinel, "free queue is corrupt"
        return ids

    # ---------------------------------------------------------------- mutations

    def allocate(self, n: int) -> list[BlockId]:
        """Take ``n`` blocks from the head of the free queue, each with ref count 1.

        Raises :class:`OutOfBlocksError` and changes nothing if fewer than ``n``
        blocks are free.
        """
        if n < 0:
            raise BlockPoolError(f"cannot allocate a negative number of blocks ({n})")
        if n > self._num_free:
            raise OutOfBlocksError(
                f"asked for {n} blocks but only {self._num_free} of "
                f"{self._num_blocks} are free; free some blocks or enlarge the pool"
            )
        allocated: list[BlockId] = []
        evicted: list[tuple[BlockHash, BlockId]] = []
        for _ in range(n):
            block_id = BlockId(self._next[self._sentinel])
            self._unlink(block_id)
            self._ref[block_id] = 1
            block_hash = self._hash[block_id]
            if block_hash is not None:
                self._drop_hash(block_id, block_hash)
                evicted.append((block_hash, block_id))
            allocated.append(block_id)
        if self._on_evict is not None:
            for block_hash, block_id in evicted:
                self._on_evict(block_hash, block_id)
        if self._events is not None and evicted:
            self._events.removed([h for h, _ in evicted])
        return allocated

    def free(self, block_ids: Sequence[BlockId]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue.

        They are appended in *reverse* order, so a request's last blocks are
        evicted first and its prefix survives longest. Validates every id first
        and changes nothing if one is out of range or has too few references.
        """
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref[block_id] < count:
                raise BlockPoolError(
                    f"cannot free block {block_id} {count} time(s): it has "
                    f"{self._ref[block_id]} reference(s) (double free?)"
                )
        for block_id in reversed(block_ids):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._append(block_id)

    def touch(self, block_ids: Iterable[BlockId]) -> None:
        """Take one reference on each block (a cache hit); free ones leave the queue."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                self._unlink(block_id)
            self._ref[block_id] += 1

    def cache_block(self, block_id: BlockId, block_hash: BlockHash) -> bool:
        """Register a referenced, full block under ``block_hash``.

        Returns True if the block is now cached under that hash (also when it
        already was), False if another block already holds the hash (the
        existing mapping wins and this block stays uncached).
        """
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            raise BlockPoolError(f"cannot cache block {block_id}: it is not referenced")
        current = self._hash[block_id]
        if current == block_hash:
            return True
        if current is not None:
            raise BlockPoolError(
                f"block {block_id} is already cached under hash {current.hex()}, "
                f"not {block_hash.hex()}; uncache it first"
            )
        if block_hash in self._hash_to_block:
            return False
        self._hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        if self._events is not None:
            self._events.stored([block_hash])
        return True

    def uncache(self, block_id: BlockId) -> None:
        """Forget a block's hash (e.g. its contents are invalid); does not call ``on_evict``."""
        self._check_id(block_id)
        block_hash = self._hash[block_id]
        if block_hash is not None:
            self._drop_hash(block_id, block_hash)
            if self._events is not None:
                self._events.removed([block_hash])

    def reset_prefix_cache(self) -> int:
        """Forget the hashes of all free cached blocks; returns how many were dropped."""
        stale = [(b, h) for h, b in self._hash_to_block.items() if self._ref[b] == 0]
        for block_id, block_hash in stale:
            self._drop_hash(block_id, block_hash)
        if self._events is not None and stale:
            self._events.removed([h for _, h in stale])
        return len(stale)

    # ------------------------------------------------------------------ helpers

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise BlockPoolError(
                f"block id {block_id} is out of range for a pool of {self._num_blocks} blocks"
            )

    def _drop_hash(self, block_id: BlockId, block_hash: BlockHash) -> None:
        assert self._hash_to_block[block_hash] == block_id
        del self._hash_to_block[block_hash]
        self._hash[block_id] = None

    def _append(self, block_id: BlockId) -> None:
        last = self._prev[self._sentinel]
        self._next[last] = block_id
        self._prev[block_id] = last
        self._next[block_id] = self._sentinel
        self._prev[self._sentinel] = block_id
        self._num_free += 1

    def _unlink(self, block_id: BlockId) -> None:
        prev, nxt = self._prev[block_id], self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block_id] = self._next[block_id] = -1
        self._num_free -= 1

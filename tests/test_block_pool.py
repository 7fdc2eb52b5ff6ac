"""Behaviour of the block pool: LRU free queue, ref counts and the prefix-hash cache."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvbridge.proto import BlockHash, BlockId, BlockPoolError, OutOfBlocksError
from kvbridge.worker.block_pool import BlockPool


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "big"))


def ids(*values: int) -> list[BlockId]:
    return [BlockId(v) for v in values]


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    n = pool.num_blocks
    return (
        pool.free_block_ids(),
        [pool.ref_count(BlockId(b)) for b in range(n)],
        [pool.block_hash(BlockId(b)) for b in range(n)],
        pool.num_free_blocks,
        pool.num_cached_blocks,
    )


class EvictionLog:
    """Hand-written fake for ``on_evict`` that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[BlockHash, BlockId]] = []

    def __call__(self, block_hash: BlockHash, block_id: BlockId) -> None:
        self.calls.append((block_hash, block_id))


# ---------------------------------------------------------------- construction


def test_new_pool_has_every_block_free_in_id_order() -> None:
    pool = BlockPool(4)
    assert pool.num_blocks == 4
    assert pool.num_free_blocks == 4
    assert pool.num_cached_blocks == 0
    assert pool.usage == 0.0
    assert pool.free_block_ids() == ids(0, 1, 2, 3)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_without_blocks_is_rejected(num_blocks: int) -> None:
    with pytest.raises(BlockPoolError, match=rf"num_blocks must be >= 1, got {num_blocks}"):
        BlockPool(num_blocks)


# ------------------------------------------------------------------ allocation


def test_allocate_takes_blocks_from_head_with_one_reference() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == ids(0, 1, 2)
    assert [pool.ref_count(b) for b in ids(0, 1, 2, 3)] == [1, 1, 1, 0]
    assert pool.free_block_ids() == ids(3)
    assert pool.usage == 0.75


def test_allocate_zero_returns_empty_list() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_allocate_negative_count_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match=r"negative number of blocks \(-1\)"):
        pool.allocate(-1)


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    log = EvictionLog()
    pool = BlockPool(4, on_evict=log)
    pool.allocate(1)
    pool.free(ids(0))
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError, match=r"asked for 3 blocks but only 2 of 4 are free"):
        pool.allocate(3)
    assert snapshot(pool) == before
    assert log.calls == []


def test_out_of_blocks_is_a_block_pool_error() -> None:
    pool = BlockPool(1)
    pool.allocate(1)
    with pytest.raises(BlockPoolError):
        pool.allocate(1)


# ------------------------------------------------------------------------ free


def test_request_blocks_freed_tail_first_so_prefix_survives() -> None:
    pool = BlockPool(4)
    request = pool.allocate(3)
    for i, block_id in enumerate(request):
        assert pool.cache_block(block_id, h(i))
    pool.free(request)
    assert pool.free_block_ids() == ids(3, 2, 1, 0)
    # A new request needing two blocks evicts the old request's last block, not its prefix.
    assert pool.allocate(2) == ids(3, 2)
    assert pool.lookup_prefix([h(0), h(1), h(2)]) == ids(0, 1)


def test_least_recently_freed_block_is_allocated_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(3) == [b, a, c]


def test_shared_block_joins_free_queue_only_when_last_reference_goes() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.ref_count(block) == 1
    assert block not in pool.free_block_ids()
    pool.free([block])
    assert pool.ref_count(block) == 0
    assert pool.free_block_ids() == ids(1, 0)


def test_free_of_duplicate_ids_counts_each_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block, block])
    assert pool.ref_count(block) == 0
    assert pool.num_free_blocks == 2


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=rf"cannot free block {a} 1 time\(s\): it has 0"):
        pool.free([b, a])
    assert snapshot(pool) == before
    assert pool.ref_count(b) == 1


def test_free_with_more_duplicates_than_references_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=rf"cannot free block {block} 2 time\(s\): it has 1"):
        pool.free([block, block])
    assert snapshot(pool) == before


@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_free_of_out_of_range_id_raises_and_changes_nothing(bad_id: int) -> None:
    pool = BlockPool(4)
    allocated = pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=rf"block id {bad_id} is out of range .* 4 blocks"):
        pool.free([*allocated, BlockId(bad_id)])
    assert snapshot(pool) == before


def test_freed_block_keeps_its_hash_as_a_cache_hit() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, h(7))
    pool.free([block])
    assert pool.block_hash(block) == h(7)
    assert pool.get_block(h(7)) == block
    assert pool.lookup_prefix([h(7)]) == [block]
    assert pool.num_cached_blocks == 1


# ---------------------------------------------------------------------- touch


def test_touch_removes_free_cached_block_from_middle_of_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.allocate(5)
    for i, block_id in enumerate(blocks):
        pool.cache_block(block_id, h(i))
    pool.free(blocks)
    assert pool.free_block_ids() == ids(4, 3, 2, 1, 0)

    hits = pool.lookup_prefix([h(0), h(1), h(2)])
    pool.touch(hits)

    assert pool.free_block_ids() == ids(4, 3)
    assert [pool.ref_count(b) for b in hits] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    # The queue stays intact at both ends after the unlinking.
    assert pool.allocate(2) == ids(4, 3)
    pool.free(hits)
    assert pool.free_block_ids() == ids(2, 1, 0)


def test_touch_of_referenced_block_adds_a_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert pool.ref_count(block) == 2
    assert pool.free_block_ids() == ids(1)


def test_touch_of_out_of_range_id_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=r"block id 3 is out of range"):
        pool.touch(ids(0, 1, 3))
    assert snapshot(pool) == before


# ------------------------------------------------------------------ eviction


def test_eviction_drops_hash_and_calls_on_evict() -> None:
    log = EvictionLog()
    pool = BlockPool(2, on_evict=log)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.free([a, b])  # queue: b, a
    assert pool.allocate(1) == [b]
    assert log.calls == []  # b had no hash
    assert pool.allocate(1) == [a]
    assert log.calls == [(h(1), a)]
    assert pool.block_hash(a) is None
    assert pool.get_block(h(1)) is None
    assert pool.num_cached_blocks == 0


def test_on_evict_sees_a_consistent_pool() -> None:
    seen: list[tuple[BlockId | None, int]] = []
    pool: BlockPool

    def on_evict(block_hash: BlockHash, block_id: BlockId) -> None:
        seen.append((pool.get_block(block_hash), pool.ref_count(block_id)))

    pool = BlockPool(2, on_evict=on_evict)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], h(0))
    pool.cache_block(blocks[1], h(1))
    pool.free(blocks)
    pool.allocate(2)
    assert seen == [(None, 1), (None, 1)]


# ---------------------------------------------------------------- cache_block


def test_cache_block_is_idempotent_for_the_same_hash() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    assert pool.cache_block(block, h(1)) is True
    assert pool.cache_block(block, h(1)) is True
    assert pool.num_cached_blocks == 1


def test_cache_block_keeps_existing_mapping_when_hash_is_taken() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1)) is True
    assert pool.cache_block(b, h(1)) is False
    assert pool.get_block(h(1)) == a
    assert pool.block_hash(b) is None


def test_cache_block_with_a_different_hash_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, h(1))
    with pytest.raises(BlockPoolError, match=r"already cached under hash 00000001, not 00000002"):
        pool.cache_block(block, h(2))
    assert pool.block_hash(block) == h(1)
    assert pool.get_block(h(2)) is None


def test_cache_block_of_unreferenced_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match=r"cannot cache block 1: it is not referenced"):
        pool.cache_block(BlockId(1), h(1))
    assert pool.num_cached_blocks == 0


def test_cache_block_of_out_of_range_id_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError, match=r"block id 2 is out of range"):
        pool.cache_block(BlockId(2), h(1))


# ---------------------------------------------------------------- lookup etc.


def test_lookup_prefix_stops_at_first_miss_and_changes_nothing() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i in (0, 1, 3):
        pool.cache_block(blocks[i], h(i))
    pool.free(blocks)
    before = snapshot(pool)
    assert pool.lookup_prefix([h(0), h(1), h(2), h(3)]) == blocks[:2]
    assert pool.lookup_prefix([h(9), h(0)]) == []
    assert pool.lookup_prefix([]) == []
    assert snapshot(pool) == before


def test_uncache_drops_mapping_without_calling_on_evict() -> None:
    log = EvictionLog()
    pool = BlockPool(2, on_evict=log)
    (block,) = pool.allocate(1)
    pool.cache_block(block, h(1))
    pool.uncache(block)
    pool.uncache(block)  # no-op when uncached
    assert pool.block_hash(block) is None
    assert pool.get_block(h(1)) is None
    assert log.calls == []
    # The hash is free to be registered by another block now.
    (other,) = pool.allocate(1)
    assert pool.cache_block(other, h(1)) is True


def test_reset_prefix_cache_drops_only_free_blocks_hashes() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for i, block_id in enumerate((a, b, c)):
        pool.cache_block(block_id, h(i))
    pool.free([a, c])
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 1
    assert pool.get_block(h(1)) == b
    assert pool.block_hash(a) is None and pool.block_hash(c) is None
    assert pool.reset_prefix_cache() == 0


@pytest.mark.parametrize("bad_id", [-1, 3])
def test_per_block_queries_reject_out_of_range_ids(bad_id: int) -> None:
    pool = BlockPool(3)
    for query in (pool.ref_count, pool.block_hash, pool.uncache):
        with pytest.raises(BlockPoolError, match=rf"block id {bad_id} is out of range"):
            query(BlockId(bad_id))


# ------------------------------------------------------ random operation sequences

NUM_HASHES = 4  # few hashes, so collisions and repeated lookups happen often
hash_indices = st.integers(min_value=0, max_value=NUM_HASHES - 1)


class BlockPoolMachine(RuleBasedStateMachine):
    """Random operation sequences against a plain-list reference model of the pool."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.evictions = EvictionLog()
        self.pool = BlockPool(1)
        # Reference model.
        self.ref: list[int] = []
        self.hash: list[BlockHash | None] = []
        self.queue: list[BlockId] = []  # free queue, head first
        self.model_evictions: list[tuple[BlockHash, BlockId]] = []
        # References the "callers" hold, one entry per reference.
        self.held: list[BlockId] = []

    @initialize(num_blocks=st.integers(min_value=1, max_value=8))
    def make_pool(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.pool = BlockPool(num_blocks, on_evict=self.evictions)
        self.ref = [0] * num_blocks
        self.hash = [None] * num_blocks
        self.queue = ids(*range(num_blocks))

    # Each helper performs one operation on the pool and the same one on the model.

    def do_allocate(self, n: int) -> list[BlockId]:
        got = self.pool.allocate(n)
        expected, self.queue = self.queue[:n], self.queue[n:]
        assert got == expected
        for b in got:
            old = self.hash[b]
            if old is not None:
                self.model_evictions.append((old, b))
                self.hash[b] = None
            self.ref[b] = 1
        self.held.extend(got)
        return got

    def do_free(self, blocks: list[BlockId]) -> None:
        self.pool.free(blocks)
        for b in reversed(blocks):
            self.held.remove(b)
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.queue.append(b)

    def do_touch(self, blocks: list[BlockId]) -> None:
        self.pool.touch(blocks)
        for b in blocks:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1
            self.held.append(b)

    def do_cache(self, block: BlockId, bh: BlockHash) -> None:
        current = self.hash[block]
        if current is not None and current != bh:
            with pytest.raises(BlockPoolError, match="already cached"):
                self.pool.cache_block(block, bh)
        elif current == bh:
            assert self.pool.cache_block(block, bh) is True
        elif bh in self.hash:
            assert self.pool.cache_block(block, bh) is False
        else:
            assert self.pool.cache_block(block, bh) is True
            self.hash[block] = bh

    def model_lookup(self, hashes: list[BlockHash]) -> list[BlockId]:
        owner = {bh: BlockId(b) for b, bh in enumerate(self.hash) if bh is not None}
        hits: list[BlockId] = []
        for bh in hashes:
            if bh not in owner:
                break
            hits.append(owner[bh])
        return hits

    @rule(indices=st.lists(hash_indices, min_size=1, max_size=4))
    def serve_request(self, indices: list[int]) -> None:
        """What the engine does: take prefix hits, allocate the rest, cache what it wrote."""
        hashes = [h(i) for i in indices]
        hits = self.pool.lookup_prefix(hashes)
        assert hits == self.model_lookup(hashes)
        self.do_touch(hits)
        missing = len(hashes) - len(hits)
        if missing > len(self.queue):
            self.do_free(hits)  # would not fit: give the hits back
            return
        new_blocks = self.do_allocate(missing)
        for block, bh in zip(new_blocks, hashes[len(hits) :], strict=True):
            self.do_cache(block, bh)

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        self.do_allocate(data.draw(st.integers(min_value=0, max_value=len(self.queue))))

    @rule(extra=st.integers(min_value=1, max_value=3))
    def allocate_too_many_is_rejected(self, extra: int) -> None:
        n = len(self.queue) + extra
        before = snapshot(self.pool)
        with pytest.raises(OutOfBlocksError, match=rf"asked for {n} blocks"):
            self.pool.allocate(n)
        assert snapshot(self.pool) == before

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(range(len(self.held))), unique=True))
        self.do_free([self.held[i] for i in chosen])

    @rule(data=st.data())
    def free_too_much_is_rejected(self, data: st.DataObject) -> None:
        block = data.draw(st.integers(min_value=-1, max_value=self.n))
        extra = [BlockId(block)] * (self.ref[block] + 1 if 0 <= block < self.n else 1)
        before = snapshot(self.pool)
        with pytest.raises(BlockPoolError, match=rf"block (id )?{block}\b"):
            self.pool.free([*self.held, *extra])
        assert snapshot(self.pool) == before

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(min_value=0, max_value=self.n - 1), max_size=2))
        self.do_touch(ids(*blocks))

    @rule(data=st.data())
    def touch_out_of_range_is_rejected(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from([-1, self.n]))
        before = snapshot(self.pool)
        with pytest.raises(BlockPoolError, match=r"out of range"):
            self.pool.touch(ids(0, bad))
        assert snapshot(self.pool) == before

    @precondition(lambda self: self.held)
    @rule(data=st.data(), hash_index=hash_indices)
    def cache(self, data: st.DataObject, hash_index: int) -> None:
        self.do_cache(data.draw(st.sampled_from(self.held)), h(hash_index))

    @precondition(lambda self: self.queue)
    @rule(data=st.data(), hash_index=hash_indices)
    def cache_free_block_is_rejected(self, data: st.DataObject, hash_index: int) -> None:
        block = data.draw(st.sampled_from(self.queue))
        before = snapshot(self.pool)
        with pytest.raises(BlockPoolError, match="not referenced"):
            self.pool.cache_block(block, h(hash_index))
        assert snapshot(self.pool) == before

    @rule(indices=st.lists(hash_indices, max_size=NUM_HASHES))
    def lookup(self, indices: list[int]) -> None:
        hashes = [h(i) for i in indices]
        before = snapshot(self.pool)
        assert self.pool.lookup_prefix(hashes) == self.model_lookup(hashes)
        assert snapshot(self.pool) == before

    @rule(data=st.data())
    def uncache(self, data: st.DataObject) -> None:
        block = data.draw(st.integers(min_value=0, max_value=self.n - 1))
        self.pool.uncache(BlockId(block))
        self.hash[block] = None

    @rule()
    def reset_prefix_cache(self) -> None:
        expected = 0
        for b in range(self.n):
            if self.ref[b] == 0 and self.hash[b] is not None:
                self.hash[b] = None
                expected += 1
        assert self.pool.reset_prefix_cache() == expected

    @rule()
    def free_everything_returns_pool_to_full(self) -> None:
        self.do_free(list(self.held))
        assert self.held == []
        assert self.pool.num_free_blocks == self.n
        assert self.pool.usage == 0.0

    @invariant()
    def matches_reference_model(self) -> None:
        assert self.pool.free_block_ids() == self.queue
        assert [self.pool.ref_count(BlockId(b)) for b in range(self.n)] == self.ref
        assert [self.pool.block_hash(BlockId(b)) for b in range(self.n)] == self.hash
        assert self.evictions.calls == self.model_evictions

    @invariant()
    def ref_counts_never_negative(self) -> None:
        assert all(self.pool.ref_count(BlockId(b)) >= 0 for b in range(self.n))

    @invariant()
    def block_is_either_free_or_referenced(self) -> None:
        free = self.pool.free_block_ids()
        assert len(free) == len(set(free)) == self.pool.num_free_blocks
        for b in range(self.n):
            assert (b in free) == (self.pool.ref_count(BlockId(b)) == 0)
        referenced = sum(1 for b in range(self.n) if self.pool.ref_count(BlockId(b)) > 0)
        assert self.pool.num_free_blocks + referenced == self.n
        assert self.pool.usage == pytest.approx(referenced / self.n)

    @invariant()
    def hash_map_agrees_with_block_hashes(self) -> None:
        cached = 0
        for b in range(self.n):
            bh = self.pool.block_hash(BlockId(b))
            if bh is not None:
                cached += 1
                assert self.pool.get_block(bh) == b
        assert self.pool.num_cached_blocks == cached
        for i in range(NUM_HASHES):
            owner = self.pool.get_block(h(i))
            assert owner is None or self.pool.block_hash(owner) == h(i)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None
)
test_block_pool_matches_reference_model = BlockPoolMachine.TestCase

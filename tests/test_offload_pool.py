"""The offload daemon's host pool bookkeeping, in process (no NIXL, no gRPC).

LRU eviction over committed, unpinned blocks; uncommitted stores are invisible
and unevictable; aborts, dead writers (expiry) and finished loads give slots
back; the pool never holds more than its capacity.
"""

from __future__ import annotations

import contextlib
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kernels import ALGO_XXH3
from kvbridge.proto import BlockHash, ConfigError, LeaseError, WireError
from kvbridge.worker.offload import OffloadConfig
from kvbridge.worker.offload.pool import HostPool, PreparedStore, pool_key

TTL = 10.0
DIGEST = bytes(range(16))


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def keys(tag: str, n: int, tp_rank: int = 0) -> list[BlockHash]:
    return [pool_key(tp_rank, hashlib.sha256(f"{tag}{i}".encode()).digest()) for i in range(n)]


def commit(pool: HostPool, prep: PreparedStore, writer: str = "") -> int:
    """What the daemon does when ``writer``'s WRITE notification arrived, then the commit."""
    pool.mark_written(prep.store_id, writer)
    return pool.commit_store(prep.store_id, writer, 7, [DIGEST] * len(prep.slots))


def stored(pool: HostPool, ks: list[BlockHash]) -> list[bytes]:
    """Store and commit ``ks``; returns the evicted hashes."""
    prep = pool.prepare_store(ks, TTL)
    commit(pool, prep)
    return list(prep.evicted)


def test_a_store_gets_ascending_slots_even_when_the_free_queue_holds_them_reversed() -> None:
    # a committed store's slots go back to the free queue tail first (last block evicted
    # first), so the next store evicts them in descending order; handed out ascending, a
    # WRITE or READ of blocks in order finds adjacent slots that NIXL merges
    pool = HostPool(8, 100)
    for tag in ("a", "b", "c"):
        prep = pool.prepare_store(keys(tag, 8), TTL)
        assert list(prep.slots) == list(range(8)), prep.slots
        commit(pool, prep)
        loaded = pool.prepare_load(keys(tag, 8), TTL)
        assert list(loaded.slots) == list(range(8))
        pool.complete_load(loaded.load_id)
    pool.check()


def test_committed_blocks_are_found_by_prefix_and_others_are_misses() -> None:
    pool = HostPool(8, 100)
    ks = keys("a", 4)
    stored(pool, ks[:3])
    assert pool.lookup(ks) == 3
    assert pool.lookup([*keys("z", 1), *ks]) == 0
    s = pool.stats()
    assert (s.hits, s.misses, s.stored_blocks, s.stored_bytes) == (3, 6, 3, 300)
    pool.check()


def test_uncommitted_store_is_invisible_and_abort_frees_its_slots() -> None:
    pool = HostPool(4, 1)
    ks = keys("a", 4)
    prep = pool.prepare_store(ks, TTL)
    assert len(prep.slots) == 4 and prep.indices == (0, 1, 2, 3)
    assert pool.lookup(ks) == 0
    assert pool.prepare_load(ks, TTL).load_id == ""
    # a second writer of the same hashes gets nothing to write, and no room either
    assert pool.prepare_store(ks, TTL).store_id == ""
    assert pool.prepare_store(keys("b", 1), TTL).store_id == ""
    assert pool.abort_store(prep.store_id)
    assert not pool.abort_store(prep.store_id)
    assert pool.lookup(ks) == 0
    assert len(pool.prepare_store(keys("b", 4), TTL).slots) == 4
    pool.check()


def test_dead_writer_store_expires_and_its_slots_are_reused() -> None:
    clock = FakeClock()
    pool = HostPool(2, 1, clock=clock)
    prep = pool.prepare_store(keys("a", 2), ttl_s=1.0)
    clock.t += 1.5
    assert pool.expire() == 1
    with pytest.raises(LeaseError, match="unknown, expired or already finished"):
        commit(pool, prep)
    assert pool.lookup(keys("a", 2)) == 0
    assert len(pool.prepare_store(keys("b", 2), TTL).slots) == 2
    assert pool.stats().expired == 1
    pool.check()


def test_eviction_takes_least_recently_used_blocks_tail_of_a_prefix_first() -> None:
    pool = HostPool(6, 1)
    a, b = keys("a", 3), keys("b", 3)
    stored(pool, a)
    stored(pool, b)
    # a load refreshes a: b becomes the least recently used
    load = pool.prepare_load(a, TTL)
    assert pool.complete_load(load.load_id)
    evicted = stored(pool, keys("c", 2))
    assert evicted == [b[2][2:], b[1][2:]]  # the tail of b's prefix goes first
    assert pool.lookup(a) == 3 and pool.lookup(b) == 1
    pool.check()


def test_pinned_blocks_are_never_evicted_and_unpin_makes_them_evictable() -> None:
    pool = HostPool(4, 1)
    a = keys("a", 4)
    stored(pool, a)
    load = pool.prepare_load(a[:2], TTL)
    assert len(load.slots) == 2
    prep = pool.prepare_store(keys("b", 4), TTL)
    assert len(prep.slots) == 2 and set(prep.slots).isdisjoint(load.slots)
    commit(pool, prep)
    assert pool.lookup(a) == 2
    # the only evictable blocks are b's: the pinned prefix of a stays
    for i in range(4):
        prep = pool.prepare_store(keys(f"c{i}", 1), TTL)
        assert not set(prep.slots) & set(load.slots)
        if prep.store_id:
            commit(pool, prep)
    assert pool.lookup(a) == 2
    pool.complete_load(load.load_id)
    assert pool.stats().pinned_blocks == 0
    assert set(pool.prepare_store(keys("d", 4), TTL).slots) >= set(load.slots)
    pool.check()


def test_expired_load_unpins() -> None:
    clock = FakeClock()
    pool = HostPool(2, 1, clock=clock)
    a = keys("a", 2)
    stored(pool, a)
    load = pool.prepare_load(a, ttl_s=1.0)
    clock.t += 2
    assert not pool.complete_load(load.load_id)
    assert pool.stats().pinned_blocks == 0


def test_tensor_parallel_ranks_have_separate_entries() -> None:
    pool = HostPool(8, 1)
    stored(pool, keys("a", 2, tp_rank=0))
    assert pool.lookup(keys("a", 2, tp_rank=1)) == 0
    assert pool.lookup(keys("a", 2, tp_rank=0)) == 2


def test_duplicate_hashes_in_one_store_take_one_slot() -> None:
    pool = HostPool(4, 1)
    k = keys("a", 1)
    prep = pool.prepare_store([k[0], k[0]], TTL)
    assert prep.indices == (0,)
    commit(pool, prep)
    assert pool.stats().cached_blocks == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "commit", "abort", "load", "complete", "tick"]),
        st.integers(0, 20),
        st.integers(1, 6),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_capacity_is_never_exceeded_and_slots_are_never_lost(script: list) -> None:  # type: ignore[type-arg]
    clock = FakeClock()
    capacity = 5
    pool = HostPool(capacity, 1, clock=clock, grace_s=2.0)
    stores: list[PreparedStore] = []
    loads: list[str] = []
    for op, start, n in script:
        ks = keys("k", 24)[start : start + n]
        if op == "store":
            prep = pool.prepare_store(ks, ttl_s=3.0)
            assert len(set(prep.slots)) == len(prep.slots)
            if prep.store_id:
                stores.append(prep)
        elif op == "commit" and stores:
            with contextlib.suppress(LeaseError):
                commit(pool, stores.pop(start % len(stores)))
        elif op == "abort" and stores:
            pool.abort_store(stores.pop(start % len(stores)).store_id)
        elif op == "load":
            load = pool.prepare_load(ks, ttl_s=3.0)
            if load.load_id:
                loads.append(load.load_id)
        elif op == "complete" and loads:
            pool.complete_load(loads.pop(start % len(loads)))
        elif op == "tick":
            clock.t += n
            pool.expire()
        pool.check()
        s = pool.stats()
        assert s.cached_blocks + s.writing_blocks + s.quarantined_blocks <= capacity
    for prep in stores:
        pool.abort_store(prep.store_id)
    for load_id in loads:
        pool.complete_load(load_id)
    s = pool.stats()
    assert (s.writing_blocks, s.pinned_blocks) == (0, 0)
    clock.t += 2.0  # past every grace period
    pool.expire()
    assert pool.stats().quarantined_blocks == 0
    # every slot is usable again
    fresh = pool.prepare_store(keys("fresh", capacity), TTL)
    assert len(fresh.slots) == capacity


def test_an_unwritten_expired_or_aborted_store_sits_out_the_grace_a_written_one_does_not() -> None:
    clock = FakeClock()
    pool = HostPool(16, 1, clock=clock, grace_s=5.0)  # holds at most 16 // 4 slots
    late = pool.prepare_store(keys("late", 2), ttl_s=1.0)  # its WRITE never completed
    done = pool.prepare_store(keys("done", 2), ttl_s=1.0)
    pool.mark_written(done.store_id, "")  # its WRITE completed: nothing can land later
    clock.t += 1.5
    assert pool.expire() == 2
    s = pool.stats()
    assert (s.writing_blocks, s.quarantined_blocks) == (0, 2)
    rest = pool.prepare_store(keys("next", 16), TTL)
    assert len(rest.slots) == 14 and not set(rest.slots) & set(late.slots)
    clock.t += 1.0
    assert pool.abort_store(rest.store_id)  # aborted before its WRITE: quarantined too,
    assert pool.stats().quarantined_blocks == 4  # up to a quarter of the pool; the rest is free
    assert len(pool.prepare_store(keys("more", 16), TTL).slots) == 12
    pool.check()
    clock.t += 4.0  # the late store's grace is over, the aborted one's not yet
    pool.expire()
    assert pool.stats().quarantined_blocks == 2
    assert set(pool.prepare_store(keys("x", 2), TTL).slots) == set(late.slots)
    pool.check()


def test_a_reported_bad_block_is_dropped_only_if_the_daemon_confirms_it() -> None:
    pool = HostPool(4, 1)
    a = keys("a", 3)
    stored(pool, a)
    load = pool.prepare_load(a, TTL)
    assert load.digests == ((7, DIGEST, ALGO_XXH3),) * 3  # no algorithm named: XXH3
    with pytest.raises(WireError, match="bad positions"):
        pool.drop_bad(load.load_id, "", [3], lambda slot, d: False)
    bad_slot = load.slots[1]
    dropped = pool.drop_bad(load.load_id, "", [0, 1], lambda slot, d: slot != bad_slot)
    assert dropped == 1
    assert pool.complete_load(load.load_id)
    assert pool.lookup(a) == 1
    s = pool.stats()
    assert (s.bad_digest_reports, s.bad_digest_blocks) == (2, 1)
    pool.check()


def test_a_commit_without_one_digest_per_slot_is_refused_and_changes_nothing() -> None:
    pool = HostPool(4, 1)
    prep = pool.prepare_store(keys("a", 2), TTL)
    pool.mark_written(prep.store_id, "")
    with pytest.raises(WireError, match="2 slots"):
        pool.commit_store(prep.store_id, "", 1, [DIGEST])
    with pytest.raises(WireError, match="16-byte"):
        pool.commit_store(prep.store_id, "", 1, [DIGEST, b"short"])
    assert pool.stats().writing_blocks == 2
    assert pool.commit_store(prep.store_id, "", 1, [DIGEST, DIGEST]) == 2
    pool.check()


@pytest.mark.parametrize("grace", [-1.0, float("inf"), float("nan")])
def test_a_grace_period_that_is_not_a_finite_nonnegative_number_is_refused(grace: float) -> None:
    with pytest.raises(ConfigError, match="grace"):
        HostPool(4, 1, grace_s=grace)
    with pytest.raises(ConfigError, match="expired_grace_s"):
        OffloadConfig(expired_grace_s=grace)

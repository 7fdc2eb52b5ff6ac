"""The lease table: every lease's blocks are unpinned exactly once (injected clock, no gRPC)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

import pytest

from kvbridge.connector.control import BlockOwner, LeaseTable
from kvbridge.proto import (
    BlockHash,
    BlockId,
    ConfigError,
    ControlPlaneError,
    LeaseError,
    LeaseId,
    RequestId,
)
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.pool_owner import PoolBlockOwner


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RecordingOwner(BlockOwner):
    """Remembers every unpin; the pool itself would raise on a double free."""

    def __init__(self, num_blocks: int = 8) -> None:
        self.pool = BlockPool(num_blocks)
        self.unpinned: list[dict[str, list[BlockId]]] = []
        self.lock = threading.Lock()
        self.fail = False

    def num_blocks(self, group: str) -> int:
        return self.pool.num_blocks if group == "self" else 0

    def pin_hashes(
        self, group_hashes: Mapping[str, Sequence[BlockHash]]
    ) -> dict[str, list[BlockId]]:
        raise AssertionError("not used here")

    def unpin(self, blocks: Mapping[str, Sequence[BlockId]]) -> None:
        with self.lock:
            self.unpinned.append({g: list(ids) for g, ids in blocks.items()})
            if self.fail:
                raise RuntimeError("owner broke")
            self.pool.free(list(blocks["self"]))

    def take(self, n: int) -> list[BlockId]:
        with self.lock:
            return self.pool.allocate(n)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def owner() -> RecordingOwner:
    return RecordingOwner()


@pytest.fixture
def table(owner: RecordingOwner, clock: Clock) -> LeaseTable:
    return LeaseTable(owner, clock=clock)


def test_lease_ids_are_random_128_bit_hex(table: LeaseTable, owner: RecordingOwner) -> None:
    a = table.create({"self": owner.take(1)}, ttl_s=1)
    b = table.create({"self": owner.take(1)}, ttl_s=1)
    assert a.lease_id != b.lease_id
    assert len(a.lease_id) == 32 and int(a.lease_id, 16) >= 0
    assert table.release_all() == 2


def test_expiry_unpins_once_and_a_later_release_is_a_no_op(
    table: LeaseTable, owner: RecordingOwner, clock: Clock
) -> None:
    ids = owner.take(3)
    lease = table.create({"self": ids}, ttl_s=5, hashes={"self": []})
    clock.t = 4.9
    assert table.expire() == 0 and table.get(lease.lease_id) == lease
    clock.t = 5.0
    assert table.expire() == 1
    assert table.expire() == 0
    assert table.release(lease.lease_id) is False
    assert owner.unpinned == [{"self": ids}]
    assert owner.pool.num_free_blocks == owner.pool.num_blocks


def test_heartbeat_extends_but_never_shortens(
    table: LeaseTable, owner: RecordingOwner, clock: Clock
) -> None:
    lease = table.create({"self": owner.take(1)}, ttl_s=10)
    [longer] = table.heartbeat([lease.lease_id], ttl_s=20)
    assert longer.expires_at == 20
    [same] = table.heartbeat([lease.lease_id], ttl_s=1)
    assert same.expires_at == 20
    clock.t = 15  # the original deadline (10) has passed; the stale heap entry is skipped
    assert table.expire() == 0 and len(table) == 1
    clock.t = 20
    assert table.heartbeat([lease.lease_id, LeaseId("0" * 32)], ttl_s=5) == []
    assert len(owner.unpinned) == 1


def test_request_lease_is_found_by_request_id_until_released(
    table: LeaseTable, owner: RecordingOwner
) -> None:
    lease = table.create({"self": owner.take(2)}, ttl_s=5, request_id=RequestId("r1"))
    assert table.get_by_request(RequestId("r1")) == lease
    with pytest.raises(LeaseError, match="already has a lease"):
        table.create({"self": []}, ttl_s=5, request_id=RequestId("r1"))
    assert table.release(lease.lease_id) is True
    assert table.get_by_request(RequestId("r1")) is None


def test_a_full_table_refuses_new_leases_and_the_caller_keeps_its_pin(
    owner: RecordingOwner,
) -> None:
    table = LeaseTable(owner, max_leases=1)
    table.create({"self": owner.take(1)}, ttl_s=5)
    with pytest.raises(ControlPlaneError, match="limit is 1") as info:
        table.create({"self": [BlockId(7)]}, ttl_s=5)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert not table.has_room()
    assert table.release_all() == 1
    assert owner.unpinned == [{"self": [0]}]


def test_a_failing_owner_is_logged_and_the_lease_is_still_gone(
    table: LeaseTable, owner: RecordingOwner, caplog: pytest.LogCaptureFixture
) -> None:
    lease = table.create({"self": owner.take(1)}, ttl_s=5)
    owner.fail = True
    with caplog.at_level(logging.ERROR):
        assert table.release(lease.lease_id) is True
    assert "failed to unpin" in caplog.text
    assert table.release(lease.lease_id) is False
    assert len(owner.unpinned) == 1
    owner.fail = False
    owner.pool.free([BlockId(0)])


def test_racing_release_and_expiry_unpin_each_lease_exactly_once(
    owner: RecordingOwner, clock: Clock
) -> None:
    owner = RecordingOwner(num_blocks=512)
    table = LeaseTable(owner, clock=clock)
    leases = [table.create({"self": owner.take(1)}, ttl_s=1) for _ in range(400)]
    clock.t = 2  # all expired: reaper and releasers race
    barrier = threading.Barrier(5)

    def releaser(part: int) -> None:
        barrier.wait()
        for lease in leases[part::4]:
            table.release(lease.lease_id)

    def reaper() -> None:
        barrier.wait()
        for _ in range(50):
            table.expire()

    threads = [threading.Thread(target=releaser, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=reaper))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(owner.unpinned) == 400 and len(table) == 0
    assert owner.pool.num_free_blocks == 512


def test_bad_ttl_and_bad_size_are_config_errors(table: LeaseTable, owner: RecordingOwner) -> None:
    with pytest.raises(ConfigError, match="ttl_s"):
        table.create({"self": []}, ttl_s=0)
    with pytest.raises(ConfigError, match="max_leases"):
        LeaseTable(owner, max_leases=0)


def test_pool_block_owner_pins_the_longest_cached_prefix_per_group() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    hs = [BlockHash(b"a" * 16), BlockHash(b"b" * 16), BlockHash(b"c" * 16)]
    for b, h in zip(ids, hs, strict=False):
        pool.cache_block(b, h)
    pool.free(ids)
    owner = PoolBlockOwner({"self": pool})
    assert owner.num_blocks("self") == 4 and owner.num_blocks("cross") == 0
    pinned = owner.pin_hashes({"self": hs, "cross": hs})
    assert pinned == {"self": ids, "cross": []}
    assert pool.num_free_blocks == 2
    owner.unpin(pinned)
    assert pool.num_free_blocks == 4


def test_a_lease_made_under_the_callers_id_answers_to_it_and_the_id_is_not_reused(
    table: LeaseTable, owner: RecordingOwner
) -> None:
    from kvbridge.connector.control.leases import HandOverDigests, new_lease_id

    name = new_lease_id()
    digests = HandOverDigests("xxh3-128", {"self": (b"d" * 16,)})
    ids = owner.take(1)
    lease = table.create({"self": ids}, ttl_s=5, lease_id=name, digests=digests)
    assert lease.lease_id == name and table.get(name) == lease
    assert table.digests(name) == digests
    with pytest.raises(LeaseError, match="already in use"):
        table.create({"self": owner.take(1)}, ttl_s=5, lease_id=name)
    assert [x.lease_id for x in table.heartbeat([name], ttl_s=9)] == [name]
    assert table.release(name) and owner.unpinned == [{"self": ids}]
    assert table.digests(name) is None  # the digests went with the lease
    assert len(table) == 0


def test_digests_wait_for_a_lease_its_owner_named_but_has_not_made_yet(
    table: LeaseTable, owner: RecordingOwner
) -> None:
    from kvbridge.connector.control.leases import HandOverDigests, new_lease_id

    name = new_lease_id()
    digests = HandOverDigests("xxh3-128", {"self": (b"d" * 16,)})
    assert table.digests(name, wait_s=0.0) is None
    maker = threading.Timer(
        0.2, lambda: table.create({"self": owner.take(1)}, ttl_s=5, lease_id=name, digests=digests)
    )
    maker.start()
    try:
        assert table.digests(name, wait_s=30.0) == digests
    finally:
        maker.join()
    assert table.release_all() == 1

"""Bounded state per peer: per-peer lease and block caps, clamped TTLs, memory given back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.connector.control import ControlServerConfig
from kvbridge.connector.control.auth import peer_host
from kvbridge.connector.control.leases import BlockOwner, LeaseTable, PeerCaps
from kvbridge.proto import (
    BlockHash,
    BlockId,
    ConfigError,
    ControlPlaneError,
    LeaseId,
    preset_layout,
)
from tests.harness.control import Cluster, hashes, start_cluster, stop_cluster


class CountingOwner(BlockOwner):
    """Pins nothing by hash; counts unpins (leases here hold made-up block ids)."""

    def __init__(self) -> None:
        self.unpins = 0

    def num_blocks(self, group: str) -> int:
        return 1 << 20

    def pin_hashes(self, group_hashes: object) -> dict[str, list[BlockId]]:
        raise AssertionError("not used here")

    def unpin(self, blocks: object) -> None:
        self.unpins += 1


def ids(n: int, first: int = 0) -> dict[str, list[BlockId]]:
    return {"self": [BlockId(i) for i in range(first, first + n)]}


def test_a_peer_over_its_lease_cap_is_refused_and_others_are_not() -> None:
    table = LeaseTable(CountingOwner())
    caps = PeerCaps(max_leases=2, max_blocks=100)
    a = [table.create(ids(1), ttl_s=60, peer="10.0.0.1", caps=caps) for _ in range(2)]
    with pytest.raises(ControlPlaneError, match="exceed its caps") as info:
        table.create(ids(1), ttl_s=60, peer="10.0.0.1", caps=caps)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    table.create(ids(1), ttl_s=60, peer="10.0.0.2", caps=caps)  # another peer is unaffected
    assert table.release(a[0].lease_id)
    table.create(ids(1), ttl_s=60, peer="10.0.0.1", caps=caps)  # room again after a release
    assert table.peer_usage("10.0.0.1") == (2, 1)  # two leases on the same block


def test_a_peer_over_its_block_cap_is_refused_but_may_pin_what_it_holds_again() -> None:
    table = LeaseTable(CountingOwner())
    caps = PeerCaps(max_leases=100, max_blocks=10)
    table.create(ids(8), ttl_s=60, peer="p", caps=caps)
    with pytest.raises(ControlPlaneError, match="10 blocks"):
        table.create(ids(3, first=8), ttl_s=60, peer="p", caps=caps)
    table.create(ids(8), ttl_s=60, peer="p", caps=caps)  # the same blocks: no more memory
    assert table.peer_usage("p") == (2, 8)


def test_expired_and_released_leases_give_their_memory_back() -> None:
    now = [0.0]
    owner = CountingOwner()
    table = LeaseTable(owner, clock=lambda: now[0])
    caps = PeerCaps(max_leases=10, max_blocks=100)
    for i in range(5000):  # long TTLs, heartbeats, then releases: nothing may pile up
        lease = table.create(ids(2, first=i), ttl_s=3600, peer=f"peer-{i % 7}", caps=caps)
        table.heartbeat([lease.lease_id], ttl_s=3600 + i)
        assert table.release(lease.lease_id)
    assert len(table) == 0 and owner.unpins == 5000
    assert table.footprint() < 200
    for _ in range(3):
        table.create(ids(1), ttl_s=1, peer="q", caps=caps)
    now[0] = 10.0
    assert table.expire() == 3
    assert table.peer_usage("q") == (0, 0)
    assert table.footprint() < 200


def test_peer_caps_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_blocks"):
        PeerCaps(max_leases=1, max_blocks=0)
    with pytest.raises(ConfigError, match="max_leases_per_peer"):
        ControlServerConfig(max_leases_per_peer=0)


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:127.0.0.1:5555", "127.0.0.1"),
        ("ipv6:[::1]:5555", "[::1]"),
        ("unix:/tmp/sock", "unix:/tmp/sock"),
    ],
)
def test_the_caller_is_named_by_its_host_not_its_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host


# ----------------------------------------------------------------------- over real gRPC


@pytest.fixture
def capped() -> Iterator[Cluster]:
    config = ControlServerConfig(
        max_leases_per_peer=2, max_blocks_per_peer=6, default_ttl_s=2.0, max_ttl_s=5.0
    )
    c = start_cluster(preset_layout("tiny", num_blocks=16), config)
    yield c
    stop_cluster(c)


def pin(c: Cluster, blocks: list[BlockHash]) -> LeaseId:
    lease = c.client().pin_hashes({"self": blocks})
    assert lease.lease_id is not None
    return lease.lease_id


def test_pins_by_one_peer_stop_at_its_caps_until_it_releases(capped: Cluster) -> None:
    capped.owner.fill(hashes(8))
    client = capped.client()
    first = pin(capped, hashes(2))
    second = pin(capped, hashes(2))
    with pytest.raises(ControlPlaneError) as info:  # a third lease
        client.pin_hashes({"self": hashes(1)})
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert client.release(first)
    with pytest.raises(ControlPlaneError, match="6 blocks"):  # 7 distinct blocks > 6
        client.pin_hashes({"self": hashes(7)})
    assert len(capped.leases) == 1  # the refused pins left nothing pinned
    assert client.release(second)


def test_a_peer_asking_for_a_longer_lease_gets_the_maximum(capped: Cluster) -> None:
    capped.owner.fill(hashes(2))
    client = capped.client()
    lease = client.pin_hashes({"self": hashes(2)}, ttl_s=3600)
    assert lease.lease_id is not None
    assert 0 < lease.expires_in_s <= 5.0
    assert client.release(lease.lease_id)

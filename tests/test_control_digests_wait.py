"""``Digests`` for a hand-over whose owner has named the lease but not made it yet, over
real gRPC on loopback.

vLLM's prefill worker makes a hand-over lease (and records its digests) one engine step
after its scheduler put the lease id into kv_transfer_params, so a decode may ask first.
The owner's server waits for the lease, but only within its wait slots (2 per caller); a
call over them used to be answered NOT_FOUND at once, and the load was recomputed
though the digests were on their way. Now it is answered busy (RESOURCE_EXHAUSTED) and
the client asks again within its deadline; a lease made without digests, or one never
made, still fails NOT_FOUND (the reader recomputes), and the retries stop at the deadline.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.connector.control import ControlServerConfig
from kvbridge.connector.control.server import DIGESTS_WAIT_S
from kvbridge.connector.control.types import HandOverDigests
from kvbridge.proto import ControlPlaneError, LeaseError, LeaseId, RequestId, preset_layout
from tests.harness.control import Cluster, hashes, start_cluster, stop_cluster

SLOW = 0.3
"""How long after the first Digests call the owner makes the lease (< DIGESTS_WAIT_S)."""


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    config = ControlServerConfig(default_ttl_s=5.0, max_ttl_s=10.0, max_workers=8)
    c = start_cluster(preset_layout("tiny", num_blocks=32), config)
    yield c
    stop_cluster(c)


def digests_of(n: int, salt: int) -> HandOverDigests:
    return HandOverDigests("xxh3", {"self": tuple(bytes([salt, i]) * 8 for i in range(n))})


def make_lease(c: Cluster, lease_id: LeaseId, salt: int, digests: bool = True) -> None:
    """The owner's worker making the hand-over its scheduler already named ``lease_id``."""
    ids = c.owner.take_for_request(hashes(2, salt))
    c.leases.create(
        {"self": ids},
        ttl_s=5.0,
        hashes={"self": hashes(2, salt)},
        request_id=RequestId(f"req-{salt}"),
        lease_id=lease_id,
        digests=digests_of(2, salt) if digests else None,
    )


def wait_for_waiters(c: Cluster, n: int) -> None:
    """Until ``n`` Digests calls hold wait slots on the server (5 s at most)."""
    deadline = time.monotonic() + 5
    while c.server.handlers.digest_waits.waiting() < n:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_more_concurrent_digests_than_wait_slots_all_get_late_digests(cluster: Cluster) -> None:
    """Five loads from one decode ask at once (the per-caller cap is 2); the owner makes the
    lease SLOW later. Every call gets the digests (before: three were NOT_FOUND at once)."""
    client = cluster.client()
    lease = LeaseId(secrets.token_hex(16))
    t0 = time.monotonic()
    calls = [client.digests_call(lease, timeout_s=5.0) for _ in range(5)]
    threading.Timer(SLOW, make_lease, args=(cluster, lease, 7)).start()
    got = [call.result() for call in calls]
    took = time.monotonic() - t0
    assert all(g.groups == digests_of(2, 7).groups for g in got)
    assert SLOW <= took < SLOW + 2.0, took
    assert cluster.server.handlers.digest_waits.waiting() == 0
    assert client.release(lease)


def test_blocking_digests_over_the_cap_are_retried_and_succeed(cluster: Cluster) -> None:
    """:meth:`ControlClient.digests` (the path a reset channel falls back to) too."""
    client = cluster.client()
    lease = LeaseId(secrets.token_hex(16))
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.digests, lease, timeout_s=5.0) for _ in range(4)]
        time.sleep(SLOW)
        make_lease(cluster, lease, 8)
        got = [f.result(10) for f in futures]
    assert all(g.groups == digests_of(2, 8).groups for g in got)
    assert client.release(lease)


def test_over_the_cap_the_answer_is_busy_not_not_found(cluster: Cluster) -> None:
    """Without the retry a caller over its cap sees the distinct status and a message that
    says what to do; the waiting calls still get their digests."""
    client = cluster.client()
    lease = LeaseId(secrets.token_hex(16))
    waiting = [client.digests_call(lease, timeout_s=5.0) for _ in range(2)]
    wait_for_waiters(cluster, 2)
    with pytest.raises(ControlPlaneError, match=r"busy: .* ask again") as info:
        client.digests(lease, timeout_s=5.0, busy_retry=False)
    assert info.value.code == "RESOURCE_EXHAUSTED" and not isinstance(info.value, LeaseError)
    make_lease(cluster, lease, 9)
    assert all(w.result().groups == digests_of(2, 9).groups for w in waiting)
    assert client.release(lease)


def test_a_lease_without_digests_fails_at_once_even_over_the_cap(cluster: Cluster) -> None:
    client = cluster.client()
    lease = LeaseId(secrets.token_hex(16))
    make_lease(cluster, lease, 10, digests=False)
    t0 = time.monotonic()
    calls = [client.digests_call(lease, timeout_s=5.0) for _ in range(4)]
    for call in calls:
        with pytest.raises(LeaseError, match="no digests recorded") as info:
            call.result()
        assert info.value.code == "NOT_FOUND"
    assert time.monotonic() - t0 < DIGESTS_WAIT_S, "a made lease is not waited for"
    assert client.release(lease)


def test_a_lease_never_made_fails_not_found_long_before_the_deadline(cluster: Cluster) -> None:
    """Four concurrent calls for a lease nobody makes: two wait their DIGESTS_WAIT_S, the
    other two are busy, then wait theirs; all fail NOT_FOUND (no retry of that)."""
    client = cluster.client()
    lease = LeaseId(secrets.token_hex(16))
    t0 = time.monotonic()
    calls = [client.digests_call(lease, timeout_s=20.0) for _ in range(4)]
    for call in calls:
        with pytest.raises(LeaseError) as info:
            call.result()
        assert info.value.code == "NOT_FOUND"
    took = time.monotonic() - t0
    assert DIGESTS_WAIT_S <= took < 2 * DIGESTS_WAIT_S + 2.0, took


def test_busy_retries_stop_at_the_deadline(cluster: Cluster) -> None:
    """Wait slots held by slow calls for a lease nobody makes: a caller over the cap keeps
    being answered busy and gives up at its own deadline, not later."""
    holder = cluster.client()
    lease = LeaseId(secrets.token_hex(16))
    # each holder call waits DIGESTS_WAIT_S; keep both slots taken for longer than 0.4 s
    holding = [holder.digests_call(lease, timeout_s=5.0) for _ in range(2)]
    wait_for_waiters(cluster, 2)
    t0 = time.monotonic()
    with pytest.raises(ControlPlaneError) as info:
        holder.digests_call(lease, timeout_s=0.25).result()
    took = time.monotonic() - t0
    assert info.value.code in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"), info.value
    assert took < 0.25 + 0.2, took
    for call in holding:
        with pytest.raises(LeaseError):
            call.result()

"""The peer control service on a real loopback gRPC server.

The block owner is a hand-written fake over :class:`BlockPool` that counts
every pin it handed out, so a double unpin or a leaked pin fails the test.
Every test ends with no lease held and the pool back to full (the fixture
checks).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvbridge.connector import ServerOptions
from kvbridge.connector.control import (
    ControlClient,
    ControlServerConfig,
    PeerInfo,
    Role,
    serve,
)
from kvbridge.proto import (
    AuthError,
    BlockHash,
    ControlPlaneError,
    EngineId,
    IncompatibleLayoutError,
    KVLayout,
    LeaseError,
    Negotiation,
    RequestId,
    TransferMode,
    VersionMismatchError,
    preset_layout,
)
from tests.harness.control import (
    Cluster,
    FakeOwner,
    hashes,
    peer,
    start_cluster,
    stop_cluster,
)

NUM_BLOCKS = 16


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = start_cluster(preset_layout("tiny", num_blocks=NUM_BLOCKS))
    yield c
    stop_cluster(c)


# ------------------------------------------------------------------------- health, handshake


def test_health_names_engine_role_and_protocol(cluster: Cluster) -> None:
    info = cluster.client().health()
    assert (info.engine_id, info.role, info.protocol_version, info.num_leases) == (
        "prefill-0",
        Role.PREFILL,
        1,
        0,
    )


@pytest.mark.parametrize(
    ("server_order", "client_order", "mode"),
    [
        ("block-nhd", "block-nhd", TransferMode.WHOLE_BLOCK),
        ("block-hnd", "block-hnd", TransferMode.WHOLE_BLOCK),
        ("block-nhd", "layer-nhd", TransferMode.PER_SPAN),
        ("layer-kv-nhd", "layer-nhd", TransferMode.PER_SPAN),
        ("block-nhd", "block-hnd", TransferMode.REARRANGE),
        ("layer-nhd", "block-hnd", TransferMode.REARRANGE),
    ],
)
def test_handshake_negotiates_each_compatible_mode(
    server_order: str, client_order: str, mode: TransferMode
) -> None:
    c = start_cluster(preset_layout("small", num_blocks=NUM_BLOCKS, order=server_order))
    try:
        mine = preset_layout("small", num_blocks=64, order=client_order)
        result = c.client().handshake(peer(mine))
        assert result.negotiation.mode is mode
        assert result.peer.engine_id == "prefill-0"
        assert result.peer.agent_metadata == b"agent:prefill"
        assert result.peer.layout == c.layout
        # the server's hook learned our agent metadata, e.g. to add us as a NIXL peer
        [(seen, negotiation)] = c.handshakes
        assert seen.agent_metadata == b"agent:decode-0" and seen.layout == mine
        assert negotiation.mode is mode
    finally:
        stop_cluster(c)


@pytest.mark.parametrize(
    ("client_layout", "field_name"),
    [
        (preset_layout("small", num_blocks=NUM_BLOCKS), "model.name"),
        (preset_layout("tiny", num_blocks=NUM_BLOCKS, block_size=32), "block_size"),
        (preset_layout("tiny", num_blocks=NUM_BLOCKS, tp_size=2), "tp_size"),
    ],
)
def test_incompatible_handshake_names_the_field_and_hook_is_not_called(
    cluster: Cluster, client_layout: KVLayout, field_name: str
) -> None:
    with pytest.raises(IncompatibleLayoutError, match=rf"{field_name} differs") as info:
        cluster.client().handshake(peer(client_layout))
    assert info.value.reason
    assert cluster.handshakes == []


def test_handshake_from_another_protocol_version_names_both_versions(cluster: Cluster) -> None:
    info = PeerInfo(EngineId("old"), Role.DECODE, cluster.layout, protocol_version=99)
    with pytest.raises(VersionMismatchError, match=r"version 99.*version 1"):
        cluster.client().handshake(info)


def test_a_failing_hook_fails_the_handshake_with_its_error() -> None:
    layout = preset_layout("tiny", num_blocks=NUM_BLOCKS)
    owner = FakeOwner(layout)

    def refuse(p: PeerInfo, n: Negotiation) -> None:
        raise IncompatibleLayoutError(f"no NIXL path to {p.engine_id}")

    server = serve(peer(layout, "prefill-0", Role.PREFILL), owner, on_handshake=refuse)
    with (
        server,
        ControlClient(server.address) as client,
        pytest.raises(IncompatibleLayoutError, match="no NIXL path to decode-0"),
    ):
        client.handshake(peer(layout))


def test_every_call_has_a_deadline() -> None:
    layout = preset_layout("tiny", num_blocks=NUM_BLOCKS)
    with (
        serve(
            peer(layout, "prefill-0", Role.PREFILL),
            FakeOwner(layout),
            on_handshake=lambda p, n: time.sleep(1.0),
        ) as server,
        ControlClient(server.address, timeout_s=0.2) as client,
    ):
        t0 = time.monotonic()
        with pytest.raises(ControlPlaneError) as info:
            client.handshake(peer(layout))
        assert info.value.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - t0 < 0.9


# ------------------------------------------------------------------------------ pins, leases


def test_pin_by_hash_pins_the_longest_present_prefix(cluster: Cluster) -> None:
    hs = hashes(6)
    ids = cluster.owner.fill(hs[:4])
    client = cluster.client()
    client.handshake(peer(cluster.layout))
    pinned = client.pin_hashes({"self": hs})  # the last two were never computed
    assert pinned.lease_id is not None
    assert pinned.blocks == {"self": tuple(ids)}
    assert pinned.hashes == {"self": tuple(hs[:4])}
    assert cluster.owner.pools["self"].num_free_blocks == NUM_BLOCKS - 4
    assert client.release(pinned.lease_id) is True
    assert cluster.owner.pools["self"].num_free_blocks == NUM_BLOCKS


def test_pin_with_no_present_block_creates_no_lease(cluster: Cluster) -> None:
    pinned = cluster.client().pin_hashes({"self": hashes(3)})
    assert pinned.lease_id is None and pinned.num_blocks == 0
    assert len(cluster.leases) == 0


def test_pinned_blocks_are_never_evicted(cluster: Cluster) -> None:
    hs = hashes(4)
    cluster.owner.fill(hs)
    client = cluster.client()
    pinned = client.pin_hashes({"self": hs})
    assert pinned.lease_id is not None
    cluster.owner.evict(NUM_BLOCKS - 4)  # every block that is not pinned gets reused
    again = client.pin_hashes({"self": hs})
    assert again.blocks == pinned.blocks  # still there, same memory
    assert again.lease_id is not None
    client.release(again.lease_id)
    client.release(pinned.lease_id)


def test_expired_lease_makes_blocks_evictable_and_a_new_pin_finds_the_shorter_prefix(
    cluster: Cluster,
) -> None:
    hs = hashes(8)
    cluster.owner.fill(hs)
    client = cluster.client()
    first = client.pin_hashes({"self": hs}, ttl_s=5)
    assert first.lease_id is not None and first.num_blocks == 8

    cluster.clock.advance(4)
    cluster.owner.evict(NUM_BLOCKS - 8)  # only the unpinned blocks can go
    assert cluster.owner.pools["self"].lookup_prefix(hs) == list(first.blocks["self"])

    cluster.clock.advance(2)  # past expiry: the next call expires it lazily
    assert client.heartbeat([first.lease_id]) == frozenset()
    assert cluster.owner.pools["self"].num_free_blocks == NUM_BLOCKS  # evictable, not wiped
    # another request reuses 3 blocks; a request's tail blocks are evicted first
    cluster.owner.evict(NUM_BLOCKS - 8 + 3)

    second = client.pin_hashes({"self": hs})
    assert second.lease_id is not None
    assert second.blocks["self"] == first.blocks["self"][:5]
    assert second.hashes["self"] == tuple(hs[:5])
    assert client.release(second.lease_id) is True


def test_release_after_expiry_is_ok_and_says_nothing_was_released(cluster: Cluster) -> None:
    hs = hashes(2)
    cluster.owner.fill(hs)
    client = cluster.client()
    pinned = client.pin_hashes({"self": hs}, ttl_s=1)
    assert pinned.lease_id is not None
    cluster.clock.advance(1.5)
    assert client.release(pinned.lease_id) is False
    assert client.release(pinned.lease_id) is False
    assert cluster.owner.unpin_calls == 1


def test_heartbeat_extends_live_leases_and_omits_gone_ones(cluster: Cluster) -> None:
    hs = hashes(3)
    cluster.owner.fill(hs)
    client = cluster.client()
    a = client.pin_hashes({"self": hs[:1]}, ttl_s=2)
    b = client.pin_hashes({"self": hs}, ttl_s=2)
    assert a.lease_id is not None and b.lease_id is not None
    cluster.clock.advance(1.5)
    assert client.heartbeat([b.lease_id], ttl_s=2) == {b.lease_id}
    cluster.clock.advance(1.0)  # a expired at +2.0; b now lives until +3.5
    assert client.heartbeat([a.lease_id, b.lease_id]) == {b.lease_id}
    assert client.release(b.lease_id) is True


def test_pin_by_request_id_returns_the_lease_the_owner_created(cluster: Cluster) -> None:
    hs = hashes(3)
    ids = cluster.owner.take_for_request(hs)
    created = cluster.leases.create(
        {"self": ids}, ttl_s=2, hashes={"self": hs}, request_id=RequestId("req-1")
    )
    client = cluster.client()
    client.handshake(peer(cluster.layout))
    cluster.clock.advance(1.5)
    pinned = client.pin_request(RequestId("req-1"), ttl_s=10)
    assert pinned.lease_id == created.lease_id
    assert pinned.blocks == {"self": tuple(ids)} and pinned.hashes == {"self": tuple(hs)}
    assert pinned.request_id == "req-1"
    assert pinned.expires_in_s == pytest.approx(10)  # pinning extends it for the read
    assert client.release(created.lease_id) is True
    with pytest.raises(LeaseError, match="no lease for request 'req-1'") as info:
        client.pin_request(RequestId("req-1"))
    assert info.value.code == "NOT_FOUND"


def test_out_of_range_counts_and_sizes_are_rejected_before_any_pin(cluster: Cluster) -> None:
    client = cluster.client()
    cluster.owner.fill(hashes(2))
    cases = [
        {"self": hashes(NUM_BLOCKS + 1)},  # more blocks than the group has
        {"cross": hashes(1)},  # a group this peer does not have
        {"self": [BlockHash(b"short")]},  # hash too short
        {"self": [BlockHash(b"x" * 65)]},  # hash too long
    ]
    for case in cases:
        with pytest.raises(ControlPlaneError) as info:
            client.pin_hashes(case)
        assert info.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ControlPlaneError, match="32 lowercase hex"):
        client.release("not-a-lease")  # type: ignore[arg-type]
    assert cluster.owner.unpin_calls == 0 and +cluster.owner.pins == Counter()


def test_concurrent_pins_from_several_clients_never_unpin_twice(cluster: Cluster) -> None:
    hs = hashes(8)
    cluster.owner.fill(hs)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        client = cluster.client()
        try:
            for i in range(40):
                pinned = client.pin_hashes({"self": hs[: 1 + (seed + i) % 8]}, ttl_s=1)
                assert pinned.lease_id is not None
                if i % 3 == 0:
                    client.heartbeat([pinned.lease_id], ttl_s=1)
                if i % 4 != 3:  # else leave it to expire (the clock thread)
                    client.release(pinned.lease_id)
                    client.release(pinned.lease_id)
        except BaseException as exc:
            errors.append(exc)

    def ticker() -> None:
        while not stop.is_set():
            cluster.clock.advance(0.3)
            cluster.leases.expire()
            time.sleep(0.002)

    tick = threading.Thread(target=ticker)
    tick.start()
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    tick.join()
    assert errors == []
    cluster.clock.advance(5)
    cluster.leases.expire()
    assert cluster.owner.errors == []
    assert cluster.owner.unpin_calls == 4 * 40


# ------------------------------------------------------------------------------- auth, TLS


def test_with_a_token_a_peer_without_it_learns_nothing() -> None:
    layout = preset_layout("tiny", num_blocks=NUM_BLOCKS)
    c = start_cluster(layout, ControlServerConfig(listen=ServerOptions(token="s3cret")))
    try:
        c.owner.fill(hashes(2))
        for client in (c.client(), c.client(token="wrong")):
            for call in (
                client.health,
                lambda cl=client: cl.handshake(peer(layout)),
                lambda cl=client: cl.pin_hashes({"self": hashes(2)}),
            ):
                with pytest.raises(AuthError) as info:
                    call()
                assert "token" in str(info.value) and "prefill" not in str(info.value)
                assert info.value.code == "UNAUTHENTICATED"
        assert c.handshakes == [] and len(c.leases) == 0
        good = c.client(token="s3cret")
        assert good.handshake(peer(layout)).negotiation.mode is TransferMode.WHOLE_BLOCK
        pinned = good.pin_hashes({"self": hashes(2)})
        assert pinned.lease_id is not None and good.release(pinned.lease_id)
    finally:
        stop_cluster(c)


def test_callers_without_the_token_cannot_hold_the_servers_threads() -> None:
    """A caller without the token opens calls and never sends their body: each is refused at
    once, so the honest caller still gets its answer from a two-thread server."""
    layout = preset_layout("tiny", num_blocks=NUM_BLOCKS)
    c = start_cluster(
        layout, ControlServerConfig(listen=ServerOptions(token="s3cret"), max_workers=2)
    )
    stop = threading.Event()

    def never_sends() -> Iterator[bytes]:
        stop.wait(30)
        yield b""

    channels = [
        grpc.insecure_channel(c.server.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(6)
    ]
    try:
        held = [
            ch.stream_unary("/kvbridge.proto.PeerControl/Health").future(never_sends())
            for ch in channels
        ]
        deadline = time.monotonic() + 5
        while not all(call.done() for call in held) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(call.done() for call in held), "a half-open call holds a server thread"
        assert {call.code() for call in held} == {grpc.StatusCode.UNAUTHENTICATED}
        assert c.client(token="s3cret").health(timeout_s=3).engine_id == "prefill-0"
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        stop_cluster(c)


def test_without_a_token_configured_any_peer_may_call(cluster: Cluster) -> None:
    assert cluster.client(token="anything").health().engine_id == "prefill-0"


def test_tls_server_talks_to_a_client_that_trusts_its_certificate(
    tls_files: tuple[Path, Path],
) -> None:
    cert, key = (path.read_bytes() for path in tls_files)
    layout = preset_layout("tiny", num_blocks=NUM_BLOCKS)
    c = start_cluster(
        layout, ControlServerConfig(listen=ServerOptions(tls_cert=cert, tls_key=key, token="t"))
    )
    try:
        secure = c.client(root_cert=cert, token="t")
        assert secure.handshake(peer(layout)).peer.engine_id == "prefill-0"
        plain = c.client(token="t", timeout_s=1.0, retries=0)
        with pytest.raises(ControlPlaneError) as info:
            plain.health()
        assert info.value.code == "UNAVAILABLE"
    finally:
        stop_cluster(c)


# ----------------------------------------------------------------------------- client retries


def test_idempotent_calls_retry_on_unavailable_then_fail_typed() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with ControlClient(f"127.0.0.1:{port}", timeout_s=2.0, retries=2) as client:
        t0 = time.monotonic()
        with pytest.raises(ControlPlaneError) as info:
            client.health()
        assert info.value.code == "UNAVAILABLE"
        assert time.monotonic() - t0 < 2.0
    with pytest.raises(ControlPlaneError, match="closed"):
        client.health()


def test_bytes_that_are_not_protobuf_are_invalid_argument_on_the_control_server() -> None:
    c = start_cluster(preset_layout("tiny", num_blocks=8))
    try:
        with grpc.insecure_channel(c.server.address) as channel:
            raw = channel.unary_unary("/kvbridge.proto.PeerControl/Pin")
            with pytest.raises(grpc.RpcError) as info:
                raw(b"\xff\xfe not a protobuf message", timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    finally:
        stop_cluster(c)

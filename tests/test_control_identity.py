"""Bounded state per authenticated peer, over real gRPC on loopback.

Per-peer caps key on what a caller authenticated with (its token), not on its
source address; an owner-made hand-over lease belongs to the first peer that
pins it and nobody else may extend it; extensions stop at the lease's lifetime;
absurd TTLs are clamped and answered cleanly, and no error path leaks a lease.
Different source addresses come from a small TCP relay that dials the server
from 127.0.0.N.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvbridge.connector import ServerOptions
from kvbridge.connector.control import ControlClient, ControlServerConfig, LeaseTable, Role, serve
from kvbridge.connector.control.auth import TokenSet, token_identity
from kvbridge.connector.control.server import ControlHandlers
from kvbridge.proto import (
    ConfigError,
    ControlPlaneError,
    LeaseError,
    LeaseId,
    RequestId,
    preset_layout,
)
from kvbridge.proto import control_pb2 as pb
from kvbridge.proto import control_pb2_grpc as pb_grpc
from tests.harness.control import (
    Cluster,
    FakeOwner,
    hashes,
    peer,
    start_cluster,
    stop_cluster,
)

U64_MAX = (1 << 64) - 1


class Relay:
    """Accepts on 127.0.0.1 and dials ``target`` from source address ``source``: the
    server sees every call through it as coming from ``source``."""

    def __init__(self, target: str, source: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._source = source
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.socket()
            up.bind((self._source, 0))
            up.connect(self._target)
            self._socks += [down, up]
            threading.Thread(target=self._pump, args=(down, up), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def relays(c: Cluster, n: int) -> Iterator[list[Relay]]:
    made = [Relay(c.server.address, f"127.0.0.{i + 1}") for i in range(n)]
    try:
        yield made
    finally:
        for r in made:
            r.close()


def client_via(c: Cluster, relay: Relay, token: str | None = None) -> ControlClient:
    client = ControlClient(relay.address, token=token, timeout_s=5.0)
    c.clients.append(client)
    return client


def cluster(**knobs: object) -> Cluster:
    config = ControlServerConfig(
        **{"default_ttl_s": 2.0, "max_ttl_s": 5.0, **knobs}  # type: ignore[arg-type]
    )
    return start_cluster(preset_layout("tiny", num_blocks=32), config)


@pytest.fixture
def tokened() -> Iterator[Cluster]:
    c = cluster(listen=ServerOptions(token="shared"), max_leases_per_peer=2, max_blocks_per_peer=8)
    yield c
    stop_cluster(c)


@pytest.fixture
def open_server() -> Iterator[Cluster]:
    c = cluster(max_leases_per_peer=2, max_blocks_per_peer=8, max_lease_lifetime_s=8.0)
    yield c
    stop_cluster(c)


def hand_over(c: Cluster, request: str, n: int = 2, salt: int = 9) -> LeaseId:
    """The owner's own lease for a finished request (as prefill makes for decode)."""
    ids = c.owner.take_for_request(hashes(n, salt))
    lease = c.leases.create(
        {"self": ids}, ttl_s=2.0, hashes={"self": hashes(n, salt)}, request_id=RequestId(request)
    )
    return lease.lease_id


# ------------------------------------------------------------------ caps key on identity


def test_token_holders_on_four_source_addresses_share_one_cap(tokened: Cluster) -> None:
    tokened.owner.fill(hashes(8))
    with relays(tokened, 4) as via:
        clients = [client_via(tokened, r, token="shared") for r in via]
        held = [clients[0].pin_hashes({"self": hashes(1)}).lease_id]
        held.append(clients[1].pin_hashes({"self": hashes(1)}).lease_id)
        for other in clients[2:]:  # a new address is not a new peer
            with pytest.raises(ControlPlaneError) as info:
                other.pin_hashes({"self": hashes(1)})
            assert info.value.code == "RESOURCE_EXHAUSTED"
        ident = token_identity("shared")
        assert tokened.leases.peer_usage(ident) == (2, 1)
        for lease in held:
            assert lease is not None and clients[3].release(lease)


def test_without_a_token_the_address_is_the_identity(open_server: Cluster) -> None:
    open_server.owner.fill(hashes(8))
    with relays(open_server, 2) as (a, b):
        ca, cb = client_via(open_server, a), client_via(open_server, b)
        held = [c.pin_hashes({"self": hashes(1)}).lease_id for c in (ca, ca, cb, cb)]
        with pytest.raises(ControlPlaneError, match="exceed its caps"):
            ca.pin_hashes({"self": hashes(1)})
        assert open_server.leases.peer_usage("addr:127.0.0.2") == (2, 1)
        for lease in held:
            assert lease is not None and ca.release(lease)


# ------------------------------------------------------------- hand-over leases have an owner


def test_a_hand_over_belongs_to_the_first_peer_that_pins_it(open_server: Cluster) -> None:
    lease = hand_over(open_server, "req-1")
    with relays(open_server, 2) as (a, b):
        reader, other = client_via(open_server, a), client_via(open_server, b)
        # unclaimed, nobody's heartbeat extends it
        before = open_server.leases.get(lease)
        assert before is not None
        assert other.heartbeat([lease], ttl_s=5.0) == frozenset()
        after = open_server.leases.get(lease)
        assert after is not None and after.expires_at == before.expires_at
        pinned = reader.pin_request(RequestId("req-1"), ttl_s=5.0)
        assert pinned.lease_id == lease
        assert open_server.leases.peer_usage("addr:127.0.0.1") == (1, 2)
        # the other peer can neither pin it by request id nor extend it
        with pytest.raises(LeaseError, match="another peer holds it") as info:
            other.pin_request(RequestId("req-1"), ttl_s=5.0)
        assert info.value.code == "NOT_FOUND"
        held = open_server.leases.get(lease)
        assert other.heartbeat([lease], ttl_s=5.0) == frozenset()
        assert open_server.leases.get(lease) == held
        assert reader.heartbeat([lease], ttl_s=5.0) == {lease}
        assert reader.release(lease)
    assert open_server.leases.peer_usage("addr:127.0.0.1") == (0, 0)


def test_claiming_a_hand_over_counts_against_the_peers_caps(open_server: Cluster) -> None:
    open_server.owner.fill(hashes(8))
    first, second = hand_over(open_server, "req-1", salt=1), hand_over(open_server, "req-2", salt=2)
    with relays(open_server, 2) as (a, b):
        hoarder, reader = client_via(open_server, a), client_via(open_server, b)
        own = [hoarder.pin_hashes({"self": hashes(1)}).lease_id for _ in range(2)]
        with pytest.raises(ControlPlaneError) as info:  # a third lease for the hoarder
            hoarder.pin_request(RequestId("req-1"))
        assert info.value.code == "RESOURCE_EXHAUSTED"
        # the refused claim changed nothing: the peer it was meant for still gets it
        assert reader.pin_request(RequestId("req-1")).lease_id == first
        assert reader.pin_request(RequestId("req-2")).lease_id == second
        for lease in (first, second):
            assert reader.release(lease)
        for x in own:
            assert x is not None and hoarder.release(x)


def test_no_peer_holds_a_lease_past_its_lifetime(open_server: Cluster) -> None:
    lease = hand_over(open_server, "req-1")
    created = open_server.clock()
    with relays(open_server, 1) as (a,):
        reader = client_via(open_server, a)
        for _ in range(4):  # pin again every 2 s, asking for the longest TTL each time
            assert reader.pin_request(RequestId("req-1"), ttl_s=5.0).lease_id == lease
            got = open_server.leases.get(lease)
            assert got is not None and got.expires_at <= created + 8.0
            open_server.clock.advance(2.0)
        assert reader.heartbeat([lease], ttl_s=5.0) == frozenset()  # 8 s: its lifetime is up
        assert open_server.leases.get(lease) is None
        with pytest.raises(LeaseError):
            reader.pin_request(RequestId("req-1"))


def test_a_heartbeat_reports_the_soonest_expiry_it_left(open_server: Cluster) -> None:
    lease = hand_over(open_server, "req-1")
    with grpc.insecure_channel(open_server.server.address) as channel:
        stub = pb_grpc.PeerControlStub(channel)
        stub.Pin(pb.PinRequest(request_id="req-1", ttl_ms=5000), timeout=5)
        open_server.clock.advance(4.0)  # 4 s of its 8 s lifetime left, 5 s asked
        beat = stub.Heartbeat(pb.HeartbeatRequest(lease_ids=[lease], ttl_ms=5000), timeout=5)
        assert list(beat.alive) == [lease] and beat.expires_in_ms == 4000
        stub.Release(pb.ReleaseRequest(lease_id=lease), timeout=5)


# ------------------------------------------------------------------------ absurd TTLs


def test_a_max_ttl_beyond_a_day_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match="--max-lease-ttl"):
        ControlServerConfig(max_ttl_s=1e300)
    with pytest.raises(ConfigError, match="max_lease_lifetime_s"):
        ControlServerConfig(max_lease_lifetime_s=float("inf"))


@pytest.mark.parametrize("ttl_ms", [1, 999, 86_400_000, 86_400_001, 1 << 53, U64_MAX])
def test_any_ttl_is_clamped_and_answered(ttl_ms: int) -> None:
    c = cluster(max_ttl_s=86_400.0, default_ttl_s=30.0)
    try:
        c.owner.fill(hashes(2))
        hand_over(c, "req-1")
        with grpc.insecure_channel(c.server.address) as channel:
            stub = pb_grpc.PeerControlStub(channel)
            by_hash = stub.Pin(
                pb.PinRequest(
                    hashes=pb.PinByHashes(groups=[pb.GroupHashes(group="self", hashes=hashes(2))]),
                    ttl_ms=ttl_ms,
                ),
                timeout=5,
            )
            by_request = stub.Pin(pb.PinRequest(request_id="req-1", ttl_ms=ttl_ms), timeout=5)
            beat = stub.Heartbeat(
                pb.HeartbeatRequest(lease_ids=[by_hash.lease.lease_id], ttl_ms=ttl_ms), timeout=5
            )
            for ms in (by_hash.lease.expires_in_ms, by_request.lease.expires_in_ms):
                assert 0 <= ms <= 86_400_000
            assert beat.expires_in_ms == min(ttl_ms, 86_400_000)
            for lease in (by_hash.lease, by_request.lease):
                stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=5)
    finally:
        stop_cluster(c)


def test_a_reply_that_cannot_be_built_releases_its_new_lease(
    open_server: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_server.owner.fill(hashes(2))

    def broken(self: ControlHandlers, lease: object) -> pb.Lease:
        raise ValueError("reply does not fit")

    monkeypatch.setattr(ControlHandlers, "_lease_pb", broken)
    with pytest.raises(ControlPlaneError) as info:
        open_server.client().pin_hashes({"self": hashes(2)})
    assert info.value.code == "INTERNAL"
    assert len(open_server.leases) == 0
    assert open_server.owner.is_full()


def test_vllms_named_hand_overs_are_claimed_under_the_schedulers_id() -> None:
    """vLLM's prefill keeps hand-overs under the id its scheduler chose; claiming and the
    lifetime cap work through that name too."""
    from kvbridge.connector.control.bounds import Claimant, PeerCaps
    from kvbridge.connector.control.leases import LeaseTable, new_lease_id
    from kvbridge.connector.vllm.worker import HeldRequests
    from kvbridge.proto import BlockId

    held = HeldRequests({"self": 16})
    table = LeaseTable(held)
    name = new_lease_id()
    ids = (BlockId(1), BlockId(2))
    held.hold(RequestId("r"), ids)
    table.create(
        {"self": ids},
        ttl_s=5.0,
        hashes={"self": hashes(2)},
        request_id=RequestId("r"),
        lease_id=name,
    )
    caps = PeerCaps(max_leases=4, max_blocks=8)
    reader, other = Claimant("token:a", caps, 10.0), Claimant("token:b", caps, 10.0)
    assert table.heartbeat([name], 5.0, other) == []  # unclaimed: nobody's heartbeat
    (claimed,) = table.heartbeat([name], 5.0, reader, claim=True)
    assert claimed.lease_id == name and claimed.peer == "token:a"
    assert table.heartbeat([name], 5.0, other, claim=True) == []
    assert table.peer_usage("token:a") == (1, 2)
    assert table.release(name) and len(table) == 0


@pytest.mark.parametrize("ttl_s", [1e300, float("inf"), 2.0**70])
def test_the_client_asks_for_any_long_ttl_and_gets_the_servers_maximum(
    open_server: Cluster, ttl_s: float
) -> None:
    open_server.owner.fill(hashes(2))
    client = open_server.client()
    lease = client.pin_hashes({"self": hashes(2)}, ttl_s=ttl_s)
    assert lease.lease_id is not None and 0 < lease.expires_in_s <= 5.0
    assert client.heartbeat([lease.lease_id], ttl_s=ttl_s) == {lease.lease_id}
    assert client.release(lease.lease_id)
    with pytest.raises(ConfigError, match="ttl_s must be > 0"):
        client.heartbeat([lease.lease_id], ttl_s=float("nan"))


class LateDigests(LeaseTable):
    """An owner whose digests never arrive while ``arrive`` is unset: a ``Digests`` call
    that waits for them parks its server thread until then (a flood of unknown leases)."""

    def __init__(self, owner: FakeOwner) -> None:
        super().__init__(owner)
        self.arrive = threading.Event()
        self.waited: list[str] = []
        self._lock = threading.Lock()

    def digests(self, lease_id: LeaseId, wait_s: float = 0.0) -> None:
        if wait_s > 0:
            with self._lock:
                self.waited.append(lease_id)
            self.arrive.wait(30)
        return None


def test_a_token_holder_flooding_digests_parks_at_most_its_share_of_server_threads() -> None:
    """Each Digests call for an unknown lease used to hold a server thread for the whole
    wait: a token holder asking for a few made-up leases at once stalled every control call.
    Now a caller waits only while it holds one of its per-peer wait slots (and all callers
    only half the threads); the rest are answered busy (RESOURCE_EXHAUSTED) at once (a
    reader asks again within its deadline: tests/test_control_digests_wait.py)."""
    layout = preset_layout("tiny", num_blocks=16)
    table = LateDigests(FakeOwner(layout))
    tokens = TokenSet(["mallory", "alice", "bob"])
    config = ControlServerConfig(listen=ServerOptions(token=tokens), max_workers=8)
    server = serve(peer(layout, "prefill-0", Role.PREFILL), table, config)
    clients = {t: ControlClient(server.address, token=t, timeout_s=20) for t in tokens.accepted}
    answered: list[str] = []
    codes: list[str] = []
    lock = threading.Lock()

    def ask(who: str) -> None:
        code = "OK"
        try:
            clients[who].digests(LeaseId(secrets.token_hex(16)), busy_retry=False)
        except ControlPlaneError as exc:  # LeaseError is one too
            code = exc.code
        with lock:
            answered.append(who)
            codes.append(code)

    def settle(waited: int, done: int) -> None:
        deadline = time.monotonic() + 20
        while (len(table.waited), len(answered)) != (waited, done):
            assert time.monotonic() < deadline, (table.waited, answered)
            time.sleep(0.01)

    threads: list[threading.Thread] = []
    try:
        for who, n, waited, done in (
            ("mallory", 12, 2, 10),
            ("alice", 3, 4, 11),
            ("bob", 1, 4, 12),
        ):
            for _ in range(n):
                threads.append(threading.Thread(target=ask, args=(who,)))
                threads[-1].start()
            settle(waited, done)
        # mallory holds its 2 wait slots, alice 2: the cap of 4 (half the threads); bob
        # could not wait, and every other call was answered at once
        assert answered.count("mallory") == 10 and answered.count("alice") == 1
        assert answered.count("bob") == 1 and server.handlers.digest_waits.waiting() == 4
        assert codes == ["RESOURCE_EXHAUSTED"] * 12  # busy, not NOT_FOUND: the lease may come
        # the other half of the threads still serves everyone
        assert clients["bob"].health(timeout_s=10).engine_id == "prefill-0"
    finally:
        table.arrive.set()
        for t in threads:
            t.join(30)
        for c in clients.values():
            c.close()
        server.close()
    assert len(answered) == 16 and server.handlers.digest_waits.waiting() == 0

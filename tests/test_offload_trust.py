"""The offload daemon fails closed against forged, stale and hostile callers.

A real daemon process (``kvbridge offload serve`` via ``python -m``) or a real
gRPC server on loopback over a fake transport (the handlers never move data;
a test hands the transport the WRITE notifications NIXL would deliver).
Attackers are plain gRPC clients: no token, another worker's session, a
commit for slots nobody wrote, bytes that are not protobuf.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvbridge.connector import ServerOptions
from kvbridge.connector.control.auth import TokenSet, token_identity
from kvbridge.connector.control.errors import TOKEN_KEY
from kvbridge.connector.control.types import PeerInfo, Role, peer_to_pb
from kvbridge.connector.offload import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.offload.wire import store_notification
from kvbridge.proto import BlockHash, ConfigError, EngineId, KVLayout, preset_layout
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto import offload_pb2_grpc as pb_grpc
from kvbridge.worker.engine import EngineConfig
from kvbridge.worker.offload import OffloadConfig, OffloadServer, serve
from tests.harness.offload import DaemonProc, FakeTransport, WorkerProc

TINY_BLOCK = 2 * 4 * 16 * 2 * 32 * 4  # tiny preset: 2 x 4 layers x 16 tokens x 2 heads x 32 x fp32
TOKEN = "s3cret-token"


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


class Caller:
    """A plain gRPC client of the daemon: whatever a worker, or an attacker, can send."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub: Any = pb_grpc.OffloadStoreStub(self.channel)
        self.metadata = () if token is None else ((TOKEN_KEY, token),)
        self.session = ""
        self.instance = ""

    def __call__(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=20, metadata=self.metadata)

    def handshake(self, layout: KVLayout, agent: str) -> pb.OffloadHandshakeResponse:
        peer = PeerInfo(EngineId(agent), Role.BOTH, layout, b"md")
        req = pb.OffloadHandshakeRequest(peer=peer_to_pb(peer), agent_name=agent)
        resp = self("Handshake", req)
        self.session, self.instance = resp.session, resp.instance
        return resp

    def prepare_store(self, hs: list[bytes]) -> pb.PrepareStoreResponse:
        req = pb.PrepareStoreRequest(instance=self.instance, hashes=hs, session=self.session)
        return self("PrepareStore", req)

    def commit(self, store_id: str, n: int = 0) -> pb.CommitStoreResponse:
        """CommitStore with ``n`` (placeholder) digests, one per slot the store holds."""
        req = pb.CommitStoreRequest(
            store_id=store_id, session=self.session, digests=[bytes(16)] * n
        )
        return self("CommitStore", req)

    def lookup(self, hs: list[bytes]) -> int:
        return int(self("Lookup", pb.LookupRequest(hashes=hs)).num_hits)

    def close(self) -> None:
        self.channel.close()


def code_of(call: Callable[..., Any], *args: Any) -> grpc.StatusCode:
    """The status code ``call(*args)`` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    code: grpc.StatusCode = info.value.code()
    return code


@pytest.fixture
def server() -> Iterator[tuple[OffloadServer, FakeTransport]]:
    transport = FakeTransport()
    config = OffloadConfig(capacity_bytes=32 * TINY_BLOCK, commit_wait_s=0.2)
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        yield srv, transport


def tiny() -> KVLayout:
    return preset_layout("tiny", num_blocks=16)


# ------------------------------------------------------------------------------ token


@pytest.mark.slow
def test_without_the_token_a_caller_learns_nothing_and_cannot_fix_the_pool_layout() -> None:
    daemon = DaemonProc("--capacity", f"{32 * TINY_BLOCK}B", "--token", TOKEN)
    anonymous, wrong, worker = Caller(daemon.address), Caller(daemon.address, "nope"), None
    try:
        small = preset_layout("small", num_blocks=4)
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        for attacker in (anonymous, wrong):
            assert code_of(attacker.handshake, small, "x") == unauthenticated
            assert code_of(attacker.lookup, hashes("p", 2)) == unauthenticated
            assert code_of(attacker, "Stats", pb.StatsRequest()) == unauthenticated
        # the first *authenticated* worker fixes the layout: the anonymous "small" did not
        worker = Caller(daemon.address, TOKEN)
        resp = worker.handshake(tiny(), "worker-a")
        assert resp.capacity_blocks == 32 and resp.session
        assert worker.lookup(hashes("p", 2)) == 0
    finally:
        for c in (anonymous, wrong, worker):
            if c is not None:
                c.close()
        daemon.stop()


@pytest.mark.slow
def test_a_worker_with_token_and_tls_stores_and_loads_over_nixl(
    tls_files: tuple[Path, Path],
) -> None:
    cert, key = tls_files
    worker = WorkerProc("offload-tls")  # starts while the daemon starts
    daemon: DaemonProc | None = None
    lookups: list[OffloadLookup] = []
    try:
        daemon = DaemonProc(
            "--capacity", f"{32 * TINY_BLOCK}B", "--token", TOKEN,
            "--tls-cert", str(cert), "--tls-key", str(key),
        )  # fmt: skip
        worker.wait_ready()
        worker.call(
            "setup", address=daemon.address, preset="tiny", num_blocks=16, order="block-nhd",
            seed=5, token=TOKEN, root_cert=cert.read_bytes(),
        )  # fmt: skip
        hs = hashes("tls", 4)
        stored = worker.call("store", ids=[0, 1, 2, 3], hashes=hs)
        assert (stored["stored"], stored["error"]) == (4, "")
        original = worker.call("blocks", ids=[0, 1, 2, 3])["blocks"]
        worker.call("scramble", ids=[0, 1, 2, 3])
        got = worker.call("load", ids=[0, 1, 2, 3], hashes=hs)
        assert (got["loaded"], got["error"], got["bad_digest"]) == (4, "", 0)
        assert worker.call("blocks", ids=[0, 1, 2, 3])["blocks"] == original

        def lookup(**kw: Any) -> int:
            lookups.append(OffloadLookup(OffloadLookupConfig(daemon.address, **kw)))
            return lookups[-1].lookup([*map(BlockHash, hs)])

        assert lookup(token=TOKEN, root_cert=cert.read_bytes()) == 4
        assert lookup(token=TOKEN) == 0  # plaintext to a TLS port: a miss
        assert lookup(root_cert=cert.read_bytes()) == 0  # no token: a miss
        worker.call("close")
    finally:
        for item in lookups:
            item.close()
        worker.stop()
        if daemon is not None:
            daemon.stop()


# ------------------------------------------------------------------ commit needs the WRITE


def test_a_commit_for_slots_nobody_wrote_is_refused_and_publishes_nothing(
    server: tuple[OffloadServer, FakeTransport],
) -> None:
    srv, _ = server
    attacker = Caller(srv.address)
    try:
        attacker.handshake(tiny(), "attacker")
        popular = hashes("popular-prompt", 4)
        prep = attacker.prepare_store(popular)
        assert prep.store_id and len(prep.slots) == 4
        assert code_of(attacker.commit, prep.store_id) == grpc.StatusCode.FAILED_PRECONDITION
        assert attacker.lookup(popular) == 0
        stats = attacker("Stats", pb.StatsRequest())
        assert (stats.cached_blocks, stats.stored_blocks) == (0, 0)
    finally:
        attacker.close()


def test_a_second_worker_cannot_commit_or_abort_another_workers_store(
    server: tuple[OffloadServer, FakeTransport],
) -> None:
    srv, transport = server
    a, b = Caller(srv.address), Caller(srv.address)
    try:
        a.handshake(tiny(), "worker-a")
        b.handshake(tiny(), "worker-b")
        hs = hashes("a", 3)
        prep = a.prepare_store(hs)
        # b even sends "a's" notification from its own agent: not a's WRITE
        transport.notify("worker-b", store_notification(prep.store_id))
        assert code_of(b.commit, prep.store_id) == grpc.StatusCode.NOT_FOUND
        abort = pb.AbortStoreRequest(store_id=prep.store_id, session=b.session)
        assert not b("AbortStore", abort).aborted
        assert a.lookup(hs) == 0
        assert a("Stats", pb.StatsRequest()).writing_blocks == 3
        # a's own WRITE completes: a commits
        transport.notify("worker-a", store_notification(prep.store_id))
        assert a.commit(prep.store_id, len(prep.slots)).committed == 3
        assert b.lookup(hs) == 3
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------------- layout


@pytest.mark.slow
def test_the_pool_layout_comes_from_the_daemons_model_flag() -> None:
    daemon = DaemonProc("--capacity", f"{32 * TINY_BLOCK}B", "--model", "tiny", "--seed", "3")
    same, other = Caller(daemon.address), Caller(daemon.address)
    try:
        engine = EngineConfig.preset("tiny", seed=3).layout()  # what `kvbridge serve` registers
        assert same.handshake(engine, "worker-a").capacity_blocks == 32
        bigger = EngineConfig.preset("small").layout()
        with pytest.raises(grpc.RpcError) as info:
            other.handshake(bigger, "worker-b")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = info.value.details()
        assert engine.model.name in details and bigger.model.name in details, details
    finally:
        same.close()
        other.close()
        daemon.stop()


# ------------------------------------------------------------------------ bounded state


def test_each_peer_token_holds_at_most_its_cap_of_stores_and_pinned_blocks() -> None:
    # two tokens of one token file: two peers, each with its own caps
    transport = FakeTransport()
    config = OffloadConfig(
        capacity_bytes=32 * TINY_BLOCK,
        listen=ServerOptions(token=TokenSet(["greedy-token", "other-token"])),
        max_stores_per_writer=2,
        max_pinned_per_writer=3,
    )
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        greedy, other = Caller(srv.address, "greedy-token"), Caller(srv.address, "other-token")
        try:
            greedy.handshake(tiny(), "greedy")
            other.handshake(tiny(), "other")
            first = greedy.prepare_store(hashes("s0", 1))
            greedy.prepare_store(hashes("s1", 1))
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
            assert code_of(greedy.prepare_store, hashes("s2", 1)) == exhausted
            assert other.prepare_store(hashes("o", 1)).store_id  # others are not starved
            abort = pb.AbortStoreRequest(store_id=first.store_id, session=greedy.session)
            assert greedy("AbortStore", abort).aborted
            assert greedy.prepare_store(hashes("s3", 1)).store_id  # the quota came back
            # pins: a 4-block hit is cut to the 3 the writer may pin, then nothing more
            hs = hashes("cached", 4)
            prep = other.prepare_store(hs)
            transport.notify("other", store_notification(prep.store_id))
            assert other.commit(prep.store_id, len(prep.slots)).committed == 4
            load = pb.PrepareLoadRequest(
                instance=greedy.instance, hashes=hs, session=greedy.session
            )
            assert len(greedy("PrepareLoad", load).slots) == 3
            assert code_of(greedy, "PrepareLoad", load) == exhausted
            other_load = pb.PrepareLoadRequest(
                instance=other.instance, hashes=hs, session=other.session
            )
            assert len(other("PrepareLoad", other_load).slots) == 3
        finally:
            greedy.close()
            other.close()


def test_an_expired_store_gives_its_slots_after_the_grace_and_its_writers_quota_back() -> None:
    transport = FakeTransport()
    config = OffloadConfig(
        capacity_bytes=16 * TINY_BLOCK,
        max_stores_per_writer=1,
        reap_interval_s=0.05,
        expired_grace_s=1.0,
    )
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        w = Caller(srv.address)
        try:
            w.handshake(tiny(), "dead-writer")
            req = pb.PrepareStoreRequest(
                instance=w.instance, hashes=hashes("x", 4), session=w.session, ttl_ms=100
            )
            dead = set(w("PrepareStore", req).slots)
            assert len(dead) == 4
            pool = srv.handlers.pool
            assert pool is not None
            tick = threading.Event()  # never set: a 50 ms wait between looks
            for _ in range(200):  # the reaper, not a call of ours, expires it
                if pool.stats().writing_blocks == 0:
                    break
                tick.wait(0.05)
            assert pool.stats().writing_blocks == 0 and pool.stats().expired == 1
            assert pool.pending_of("addr:127.0.0.1") == (0, 0)
            # its WRITE never completed (it may still land): the slots sit out the grace
            assert pool.stats().quarantined_blocks == 4
            others = w.prepare_store(hashes("y", 16))
            assert len(others.slots) == 12 and not dead & set(others.slots)
            assert w(
                "AbortStore", pb.AbortStoreRequest(store_id=others.store_id, session=w.session)
            ).aborted
            pool.check()
            for _ in range(200):
                if pool.stats().quarantined_blocks == 0:
                    break
                tick.wait(0.05)
            assert len(w.prepare_store(hashes("y", 16)).slots) == 16
            pool.check()
        finally:
            w.close()


def test_the_daemon_closes_idle_connections() -> None:
    transport = FakeTransport()
    config = OffloadConfig(capacity_bytes=4 * TINY_BLOCK, idle_timeout_s=0.3)
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        c = Caller(srv.address)
        states: list[grpc.ChannelConnectivity] = []
        idle = threading.Event()

        def seen(state: grpc.ChannelConnectivity) -> None:
            states.append(state)
            if state is grpc.ChannelConnectivity.IDLE and grpc.ChannelConnectivity.READY in states:
                idle.set()

        try:
            c("Stats", pb.StatsRequest())
            c.channel.subscribe(seen)
            assert idle.wait(20), f"the connection was never closed: {states}"
        finally:
            c.channel.unsubscribe(seen)
            c.close()


# ---------------------------------------------------------------------------- malformed


GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # a length-delimited field far longer than the message


def test_bytes_that_are_not_protobuf_are_invalid_argument_on_the_daemon(
    server: tuple[OffloadServer, FakeTransport],
) -> None:
    srv, _ = server
    with grpc.insecure_channel(srv.address) as channel:
        for method in ("Handshake", "Lookup", "CommitStore"):
            raw = channel.unary_unary(f"/kvbridge.proto.OffloadStore/{method}")
            with pytest.raises(grpc.RpcError) as info:
                raw(GARBAGE, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


# ------------------------------------------------------- caps per authenticated identity


def test_a_token_holder_under_many_agent_names_shares_one_cap_of_stores_and_pins() -> None:
    # the agent name is what the caller declares; the token is what it proved: three
    # handshakes under three names with one token are one peer, charged one cap
    transport = FakeTransport()
    config = OffloadConfig(
        capacity_bytes=32 * TINY_BLOCK,
        listen=ServerOptions(token=TOKEN),
        max_stores_per_writer=2,
        max_pinned_per_writer=3,
    )
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        names = [Caller(srv.address, TOKEN) for _ in range(3)]
        try:
            for i, c in enumerate(names):
                c.handshake(tiny(), f"name-{i}")
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
            first = names[0].prepare_store(hashes("a", 1))
            assert names[1].prepare_store(hashes("b", 1)).store_id
            assert code_of(names[2].prepare_store, hashes("c", 1)) == exhausted
            assert code_of(names[0].prepare_store, hashes("d", 1)) == exhausted
            pool = srv.handlers.pool
            assert pool is not None
            peer = token_identity(TOKEN)
            assert pool.pending_of(peer) == (2, 0)
            # one name's store is still its own: another name of the same peer cannot end it
            abort = pb.AbortStoreRequest(store_id=first.store_id, session=names[1].session)
            assert not names[1]("AbortStore", abort).aborted
            abort = pb.AbortStoreRequest(store_id=first.store_id, session=names[0].session)
            assert names[0]("AbortStore", abort).aborted
            hs = hashes("cached", 4)
            prep = names[0].prepare_store(hs)
            transport.notify("name-0", store_notification(prep.store_id))
            assert names[0].commit(prep.store_id, len(prep.slots)).committed == 4

            # pins: 2 through one name, then only 1 more through another, then none
            def load(c: Caller, n: int) -> Any:
                req = pb.PrepareLoadRequest(instance=c.instance, hashes=hs[:n], session=c.session)
                return c("PrepareLoad", req)

            assert len(load(names[1], 2).slots) == 2
            assert len(load(names[2], 4).slots) == 1
            assert code_of(load, names[0], 4) == exhausted
            assert pool.pending_of(peer) == (1, 3)
            pool.check()
        finally:
            for c in names:
                c.close()


def test_a_ttl_of_any_uint64_is_clamped_to_the_maximum_and_answered() -> None:
    transport = FakeTransport()
    config = OffloadConfig(capacity_bytes=32 * TINY_BLOCK, max_ttl_s=86_400.0)
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        w = Caller(srv.address)
        try:
            w.handshake(tiny(), "w")
            pool = srv.handlers.pool
            assert pool is not None
            for ttl_ms, want in ((2**64 - 1, 86_400_000), (2**63, 86_400_000), (1, 1)):
                req = pb.PrepareStoreRequest(
                    instance=w.instance, hashes=hashes(f"t{ttl_ms}", 2), session=w.session,
                    ttl_ms=ttl_ms,
                )  # fmt: skip
                prep = w("PrepareStore", req)
                assert prep.expires_in_ms == want and len(prep.slots) == 2
                w("AbortStore", pb.AbortStoreRequest(store_id=prep.store_id, session=w.session))
                load = pb.PrepareLoadRequest(
                    instance=w.instance, hashes=hashes("none", 1), session=w.session,
                    ttl_ms=ttl_ms,
                )  # fmt: skip
                assert not w("PrepareLoad", load).load_id  # a miss, answered
            assert pool.stats().writing_blocks == 0 and pool.stats().pinned_blocks == 0
            pool.check()
        finally:
            w.close()


@pytest.mark.parametrize("max_ttl", [1e300, 86_401.0, float("inf"), float("nan")])
def test_a_max_ttl_over_a_day_or_not_finite_is_refused_naming_the_flag(max_ttl: float) -> None:
    with pytest.raises(ConfigError, match="--max-ttl"):
        OffloadConfig(max_ttl_s=max_ttl)


def test_sessions_of_one_token_share_one_cap_and_never_push_out_another_peers() -> None:
    transport = FakeTransport()
    config = OffloadConfig(
        capacity_bytes=32 * TINY_BLOCK,
        listen=ServerOptions(token=TokenSet(["flood-token", "honest-token"])),
        max_sessions=8,
        max_sessions_per_peer=3,
    )
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        honest = Caller(srv.address, "honest-token")
        flood = [Caller(srv.address, "flood-token") for _ in range(10)]
        try:
            honest.handshake(tiny(), "honest")
            for i, c in enumerate(flood):  # ten names, more than the whole table
                c.handshake(tiny(), f"name-{i}")
            assert srv.handlers.sessions.of_peer(token_identity("flood-token")) == 3
            # the honest worker's session survived; the flood's oldest went
            assert honest.prepare_store(hashes("h", 1)).store_id
            gone = grpc.StatusCode.FAILED_PRECONDITION
            assert code_of(flood[0].prepare_store, hashes("f", 1)) == gone
            assert flood[-1].prepare_store(hashes("f", 1)).store_id
            # a session id is no credential: under another token it is unknown
            flood[-1].session = honest.session
            assert code_of(flood[-1].prepare_store, hashes("g", 1)) == gone
        finally:
            for c in (honest, *flood):
                c.close()


@pytest.mark.slow
def test_a_daemon_with_a_token_file_gives_each_token_its_own_caps(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("# one per worker node\nnode-a\nnode-b\n")
    daemon = DaemonProc(
        "--capacity", f"{32 * TINY_BLOCK}B", "--token-file", str(tmp_path / "tokens"),
        "--max-stores-per-writer", "1",
    )  # fmt: skip
    a, a2, b = (Caller(daemon.address, t) for t in ("node-a", "node-a", "node-b"))
    stranger = Caller(daemon.address, "node-c")
    try:
        a.handshake(tiny(), "a-rank0")
        a2.handshake(tiny(), "a-rank1")
        b.handshake(tiny(), "b-rank0")
        assert a.prepare_store(hashes("a", 1)).store_id
        exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code_of(a2.prepare_store, hashes("a2", 1)) == exhausted  # same token, same cap
        assert b.prepare_store(hashes("b", 1)).store_id  # another token, its own cap
        unauthenticated = grpc.StatusCode.UNAUTHENTICATED
        assert code_of(stranger.handshake, tiny(), "c") == unauthenticated
        assert code_of(stranger.lookup, hashes("a", 1)) == unauthenticated
    finally:
        for c in (a, a2, b, stranger):
            c.close()
        daemon.stop()


def test_a_reply_that_cannot_be_built_leaks_no_store_and_no_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvbridge.worker.offload.handlers as handlers_module

    transport = FakeTransport()
    config = OffloadConfig(capacity_bytes=32 * TINY_BLOCK)
    with serve(transport, config) as srv:  # type: ignore[arg-type]
        w = Caller(srv.address)
        try:
            w.handshake(tiny(), "w")
            hs = hashes("kept", 2)
            prep = w.prepare_store(hs)
            transport.notify("w", store_notification(prep.store_id))
            assert w.commit(prep.store_id, len(prep.slots)).committed == 2

            def broken(seconds: float) -> int:
                raise ValueError("reply does not fit")

            monkeypatch.setattr(handlers_module, "_ms", broken)
            internal = grpc.StatusCode.INTERNAL
            assert code_of(w.prepare_store, hashes("new", 2)) == internal
            load = pb.PrepareLoadRequest(instance=w.instance, hashes=hs, session=w.session)
            assert code_of(w, "PrepareLoad", load) == internal
            pool = srv.handlers.pool
            assert pool is not None
            stats = pool.stats()
            assert (stats.writing_blocks, stats.pinned_blocks) == (0, 0)
            assert pool.pending_of("addr:127.0.0.1") == (0, 0)
            pool.check()
        finally:
            w.close()


@pytest.mark.parametrize("max_ttl", ["1e300", "inf", "90000"])
def test_the_daemon_refuses_to_start_with_a_max_ttl_over_a_day(max_ttl: str) -> None:
    out = subprocess.run(  # `kvbridge offload serve`
        [
            sys.executable,
            "-c",
            "import sys; from kvbridge.worker.cli import main; sys.exit(main())",
            "offload",
            "serve",
            "--max-ttl",
            max_ttl,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    [line] = out.stderr.strip().splitlines()  # one line, no traceback
    assert "--max-ttl" in line and "one day" in line

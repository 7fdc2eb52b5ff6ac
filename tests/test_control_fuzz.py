"""Random and malformed control requests: no crash, no state change, only expected codes.

Requests go through the raw generated stub, so nothing on the client side
cleans them up first. The owner's pool (ref counts, free queue, cached
hashes) and the lease table are compared before and after every request.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbridge.connector import ServerOptions
from kvbridge.connector.control import ControlServer, ControlServerConfig, serve
from kvbridge.connector.control.errors import TOKEN_KEY
from kvbridge.connector.control.types import PeerInfo, Role, peer_to_pb
from kvbridge.proto import PROTOCOL_VERSION, BlockHash, EngineId, preset_layout
from kvbridge.proto import control_pb2 as pb
from kvbridge.proto import control_pb2_grpc as pb_grpc
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.pool_owner import PoolBlockOwner

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}
TOKEN = "fuzz-token"
LAYOUT = preset_layout("tiny", num_blocks=16)
CACHED = [BlockHash(bytes([i]) * 16) for i in range(4)]


class Target:
    def __init__(self) -> None:
        self.pool = BlockPool(16)
        ids = self.pool.allocate(len(CACHED))
        for b, h in zip(ids, CACHED, strict=True):
            self.pool.cache_block(b, h)
        self.pool.free(ids)
        self.owner = PoolBlockOwner({"self": self.pool})
        local = PeerInfo(EngineId("prefill-0"), Role.PREFILL, LAYOUT, agent_metadata=b"secret")
        self.hooked: list[PeerInfo] = []
        self.server: ControlServer = serve(
            local,
            self.owner,
            ControlServerConfig(listen=ServerOptions(token=TOKEN)),
            on_handshake=lambda p, n: self.hooked.append(p),
        )
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.PeerControlStub(self.channel)

    def state(self) -> tuple[object, ...]:
        with self.owner.lock:
            pool = self.pool
            refs = tuple(pool.ref_count(b) for b in range(pool.num_blocks))  # type: ignore[arg-type]
            cached = tuple(pool.block_hash(b) for b in range(pool.num_blocks))  # type: ignore[arg-type]
            return refs, cached, tuple(pool.free_block_ids()), len(self.server.leases)

    def call(self, method: str, request: object, token: str | None) -> grpc.StatusCode:
        metadata = () if token is None else ((TOKEN_KEY, token),)
        try:
            getattr(self.stub, method)(request, timeout=5, metadata=metadata)
        except grpc.RpcError as err:
            code: grpc.StatusCode = err.code()
            return code
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.channel.close()
        self.server.close()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target()
    yield t
    t.close()


text = st.text(max_size=300)
blob = st.binary(max_size=300)
hash_bytes = st.one_of(blob, st.sampled_from([bytes(h) for h in CACHED]), st.just(b""))
group = st.one_of(st.sampled_from(["self", "cross", ""]), text)
hex_ish = st.one_of(text, st.text("0123456789abcdefABCDEF", min_size=30, max_size=34))
u64 = st.integers(0, 2**64 - 1)
bad_token = st.one_of(st.none(), text.filter(lambda s: s.isascii() and s.isprintable()))
token = st.sampled_from([TOKEN, TOKEN, TOKEN, None]).flatmap(
    lambda t: st.just(t) if t is not None else bad_token
)

group_hashes = st.builds(
    lambda g, hs, huge: pb.GroupHashes(group=g, hashes=hs + ([b"\0" * 16] * huge)),
    group,
    st.lists(hash_bytes, max_size=6),
    st.sampled_from([0, 0, 17, 70_000]),  # beyond the group's block count and the hash limit
)
# a request that pins nothing new: every cached hash pinned would change state, so a
# pin that could succeed starts with a hash that is never cached
missing_first = st.builds(
    lambda gh: pb.GroupHashes(group=gh.group, hashes=[b"\xff" * 16, *gh.hashes]), group_hashes
)
pin_requests = st.one_of(
    st.builds(lambda r, t: pb.PinRequest(request_id=r, ttl_ms=t), text, u64),
    st.builds(
        lambda gs, t: pb.PinRequest(hashes=pb.PinByHashes(groups=gs), ttl_ms=t),
        st.lists(
            st.one_of(missing_first, group_hashes.filter(lambda g: g.group != "self")), max_size=3
        ),
        u64,
    ),
    st.just(pb.PinRequest()),
)
peer_infos = st.builds(
    pb.PeerInfo,
    protocol_version=st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 2**32 - 1)),
    engine_id=text,
    role=st.integers(0, 7),
    tp_rank=st.integers(0, 2**32 - 1),
    tp_size=st.integers(0, 2**32 - 1),
    layout=st.one_of(blob, st.just(LAYOUT.to_bytes()), st.just(LAYOUT.to_bytes()[:-3])),
    agent_metadata=blob,
    control_address=text,
)
requests = st.one_of(
    st.tuples(st.just("Pin"), pin_requests),
    st.tuples(
        st.just("Heartbeat"),
        st.builds(pb.HeartbeatRequest, lease_ids=st.lists(hex_ish, max_size=5), ttl_ms=u64),
    ),
    st.tuples(
        st.just("Heartbeat"),
        st.just(pb.HeartbeatRequest(lease_ids=["0" * 32] * 5000)),  # beyond the per-call limit
    ),
    st.tuples(st.just("Release"), st.builds(pb.ReleaseRequest, lease_id=hex_ish)),
    st.tuples(st.just("Health"), st.just(pb.HealthRequest())),
    st.tuples(st.just("Handshake"), st.builds(pb.HandshakeRequest, peer=peer_infos)),
    st.tuples(st.just("Handshake"), st.just(pb.HandshakeRequest())),
)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests, tok=token)
def test_random_requests_change_nothing_and_get_only_expected_codes(
    target: Target, request: tuple[str, object], tok: str | None
) -> None:
    method, message = request
    before = target.state()
    hooked = len(target.hooked)
    code = target.call(method, message, tok)
    event(f"{method} -> {code.name}")
    assert code in ALLOWED, f"{method} -> {code}"
    if tok != TOKEN:
        assert code is grpc.StatusCode.UNAUTHENTICATED
        assert len(target.hooked) == hooked  # an unauthenticated peer reached nothing
    assert target.state() == before


def test_a_valid_peer_still_works_after_the_fuzzing(target: Target) -> None:
    info = PeerInfo(EngineId("decode-0"), Role.DECODE, LAYOUT)
    code = target.call("Handshake", pb.HandshakeRequest(peer=peer_to_pb(info)), TOKEN)
    assert code is grpc.StatusCode.OK
    resp = target.stub.Pin(
        pb.PinRequest(hashes=pb.PinByHashes(groups=[pb.GroupHashes(group="self", hashes=CACHED)])),
        metadata=((TOKEN_KEY, TOKEN),),
        timeout=5,
    )
    assert [list(g.block_ids) for g in resp.lease.blocks] == [[0, 1, 2, 3]]
    target.stub.Release(
        pb.ReleaseRequest(lease_id=resp.lease.lease_id), metadata=((TOKEN_KEY, TOKEN),), timeout=5
    )
    assert target.pool.num_free_blocks == 16

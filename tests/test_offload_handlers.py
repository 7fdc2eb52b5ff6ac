"""The OffloadStore handlers in process: malformed and out-of-range requests change nothing.

A fake transport stands in for NIXL (the handlers only register the pool,
export metadata and take in WRITE notifications, which a test hands it).
Hypothesis throws arbitrary requests at every handler; each either answers
or raises a typed kvbridge error, and a rejected request leaves the pool's
counters and contents exactly as they were.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.connector.control.errors import status_for
from kvbridge.connector.control.types import PeerInfo, Role, mode_from_pb, peer_to_pb
from kvbridge.connector.offload.wire import store_notification
from kvbridge.proto import EngineId, KVBridgeError, KVLayout, TransferMode, preset_layout
from kvbridge.proto import offload_pb2 as pb
from kvbridge.worker.offload.server import OffloadConfig, OffloadHandlers
from tests.harness.offload import FakeTransport

BLOCKS = 8


def worker_layout(**kw: Any) -> KVLayout:
    return preset_layout("tiny", num_blocks=16, **kw)


@pytest.fixture(scope="module")
def handlers() -> OffloadHandlers:
    layout = worker_layout()
    config = OffloadConfig(capacity_bytes=BLOCKS * layout.block_bytes())
    transport = FakeTransport()
    h = OffloadHandlers(transport, config, instance="0" * 32)  # type: ignore[arg-type]
    peer = PeerInfo(EngineId("w"), Role.BOTH, layout, b"md")
    resp = h.handshake(pb.OffloadHandshakeRequest(peer=peer_to_pb(peer), agent_name="w"))
    assert resp.capacity_blocks == BLOCKS
    # some committed content and one pinned load, so there is state to disturb
    hs = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    prep = h.prepare_store(
        pb.PrepareStoreRequest(instance=h.instance, hashes=hs, session=resp.session)
    )
    transport.notifications["w"] = [store_notification(prep.store_id)]
    h.commit_store(
        pb.CommitStoreRequest(
            store_id=prep.store_id, session=resp.session, digests=[bytes(16)] * len(prep.slots)
        )
    )
    h.prepare_load(pb.PrepareLoadRequest(instance=h.instance, hashes=hs[:2], session=resp.session))
    return h


def state(h: OffloadHandlers) -> tuple[Any, ...]:
    pool = h.pool
    assert pool is not None
    pool.check()
    s = pool.stats()
    return (s.cached_blocks, s.pinned_blocks, s.writing_blocks, s.stored_blocks, s.evicted_blocks)


hash_bytes = st.one_of(st.binary(min_size=0, max_size=80), st.just(b"\x01" * 32))
bad_hash = st.binary(max_size=80).filter(lambda b: not 8 <= len(b) <= 64)
requests = st.one_of(
    st.builds(
        pb.LookupRequest, hashes=st.lists(hash_bytes, max_size=5), tp_rank=st.integers(0, 2**32 - 1)
    ),
    st.builds(
        pb.PrepareStoreRequest,
        instance=st.one_of(st.just("0" * 32), st.text(max_size=40)),
        tp_rank=st.integers(0, 3),
        hashes=st.lists(
            st.binary(max_size=80).filter(lambda b: not 8 <= len(b) <= 64), min_size=1, max_size=4
        ),
        ttl_ms=st.integers(0, 2**64 - 1),
    ),
    st.builds(pb.CommitStoreRequest, store_id=st.text(max_size=40)),
    st.builds(pb.AbortStoreRequest, store_id=st.text(max_size=40)),
    st.builds(
        pb.PrepareLoadRequest,
        instance=st.text(max_size=40).filter(lambda s: s != "0" * 32),
        hashes=st.lists(hash_bytes, max_size=4),
    ),
    st.builds(pb.CompleteLoadRequest, load_id=st.text(max_size=40)),
    st.builds(pb.OffloadHandshakeRequest),
)

METHODS = {
    pb.LookupRequest: "lookup",
    pb.PrepareStoreRequest: "prepare_store",
    pb.CommitStoreRequest: "commit_store",
    pb.AbortStoreRequest: "abort_store",
    pb.PrepareLoadRequest: "prepare_load",
    pb.CompleteLoadRequest: "complete_load",
    pb.OffloadHandshakeRequest: "handshake",
}


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests)
def test_malformed_requests_are_rejected_without_state_change(
    handlers: OffloadHandlers, request: Any
) -> None:
    before = state(handlers)
    try:
        getattr(handlers, METHODS[type(request)])(request)
    except KVBridgeError as exc:
        code, _, message = status_for(exc)
        assert code.name in {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND"}, message
    else:
        # only a lookup (counters aside) or an answer that stores nothing may succeed here
        assert type(request) in (pb.LookupRequest, pb.AbortStoreRequest, pb.CompleteLoadRequest)
    assert state(handlers) == before


def test_out_of_range_tp_rank_and_stale_instance_name_the_problem(
    handlers: OffloadHandlers,
) -> None:
    h = [hashlib.sha256(b"x").digest()]
    with pytest.raises(KVBridgeError, match="tp_rank 5 is outside"):
        handlers.lookup(pb.LookupRequest(hashes=h, tp_rank=5))
    with pytest.raises(KVBridgeError, match="restarted"):
        handlers.prepare_store(pb.PrepareStoreRequest(instance="f" * 32, hashes=h))
    with pytest.raises(KVBridgeError, match="not 32 lowercase hex"):
        handlers.commit_store(pb.CommitStoreRequest(store_id="nope"))


def test_incompatible_worker_fails_the_handshake_with_the_reason(
    handlers: OffloadHandlers,
) -> None:
    other = preset_layout("small", num_blocks=4)
    peer = PeerInfo(EngineId("w2"), Role.BOTH, other, b"md")
    with pytest.raises(KVBridgeError, match=r"model\.name differs"):
        handlers.handshake(pb.OffloadHandshakeRequest(peer=peer_to_pb(peer), agent_name="w2"))
    # another inner order is the worker's to convert (it stages blocks in the pool's order)
    hnd = PeerInfo(EngineId("w3"), Role.BOTH, worker_layout(order="block-hnd"), b"md")
    resp = handlers.handshake(pb.OffloadHandshakeRequest(peer=peer_to_pb(hnd), agent_name="w3"))
    assert mode_from_pb(resp.mode) is TransferMode.REARRANGE


def test_calls_before_any_handshake_are_refused() -> None:
    h = OffloadHandlers(FakeTransport(), OffloadConfig(capacity_bytes=1 << 20), instance="1" * 32)  # type: ignore[arg-type]
    with pytest.raises(KVBridgeError, match="call Handshake first"):
        h.lookup(pb.LookupRequest(hashes=[b"\x00" * 16]))

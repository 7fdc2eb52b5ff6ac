"""A hung offload daemon costs the scheduler one short lookup deadline, never a handshake.

The scheduler plans loads on the engine's one scheduling thread; asking the daemon there
must be bounded: a daemon restart is a cache miss, not an error, and a hung daemon
is one too. The daemon here is a real gRPC server on loopback that accepts every call and never
answers, like a SIGSTOPped daemon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvbridge.connector import ConnectorConfig, RequestView
from kvbridge.connector.offload import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.planner import KVBridgePlanner
from kvbridge.proto import BlockHash, RequestId

BS = 16


class _HangEveryCall(grpc.GenericRpcHandler):
    """Accepts any method and answers only when released (then UNAVAILABLE)."""

    def __init__(self, released: threading.Event) -> None:
        self.released = released

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.released.wait(120)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the hung daemon was released")
            raise AssertionError("unreachable")

        return grpc.unary_unary_rpc_method_handler(hang)


class HungDaemon:
    """A daemon that accepts connections and calls and never answers until released."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        self.server.add_generic_rpc_handlers((_HangEveryCall(self.released),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def close(self) -> None:
        self.released.set()  # calls still waiting end with UNAVAILABLE
        self.server.stop(grace=None).wait()


@pytest.fixture
def hung_daemon() -> Iterator[HungDaemon]:
    daemon = HungDaemon()
    try:
        yield daemon
    finally:
        daemon.close()


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = call()
    return out, time.monotonic() - t0


def test_scheduler_lookup_on_a_hung_daemon_is_a_miss_within_its_deadline(
    hung_daemon: HungDaemon,
) -> None:
    sched = KVBridgePlanner(ConnectorConfig(engine_id="hang-test"), BS)
    lookup = OffloadLookup(OffloadLookupConfig(hung_daemon.address, timeout_s=0.5, backoff_s=60))
    sched.attach(None, lookup)  # type: ignore[arg-type]  # no lease issuer: not a prefill
    request = RequestView(
        RequestId("r1"),
        list(range(4 * BS + 3)),
        {"self": [BlockHash(bytes([i]) * 32) for i in range(4)]},
    )
    try:
        first, first_s = _timed(lambda: sched.get_num_new_matched_tokens(request, 0))
        again, again_s = _timed(lambda: sched.get_num_new_matched_tokens(request, 0))
    finally:
        lookup.close()
    assert first == (0, False) and again == (0, False)  # misses: nothing to load
    assert first_s < 1.5, f"the lookup took {first_s:.2f} s on a hung daemon"
    assert again_s < 0.1, f"inside the backoff the daemon was asked again ({again_s:.2f} s)"


@pytest.mark.slow
def test_a_node_whose_offload_daemon_hangs_serves_a_request_without_waiting_for_it(
    hung_daemon: HungDaemon, tmp_path: Path
) -> None:
    from kvbridge.worker.serving import EngineClient, start_node
    from tests.harness.nodes import node_args

    prompt = list(range(1, 4 * BS + 4))  # 4 full blocks: the scheduler asks the daemon
    extra = ["--offload", hung_daemon.address]
    with start_node("both", node_args(), "block-nhd", tmp_path, None, extra) as (_, info):
        client = EngineClient(info["inference"], timeout_s=120)
        try:
            client.generate(prompt[:8], 2, "warm-up")  # first step pays for torch warm-up
            res, elapsed_s = _timed(lambda: client.generate(prompt, 4, "r1"))
        finally:
            client.close()
            hung_daemon.close()  # let the node's pending store fail now, so it stops at once
    assert len(res.token_ids) == 4
    assert res.stats.blocks_offloaded == 0 and not res.stats.load_error
    # the old wiring asked through the worker's offload session, whose handshake waits 60 s
    assert res.stats.ttft_ms < 5000, f"ttft {res.stats.ttft_ms:.0f} ms on a hung daemon"
    assert elapsed_s < 10, f"a request took {elapsed_s:.1f} s on a hung daemon"

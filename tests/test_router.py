"""The router serves through node faults: another healthy node of the same role answers."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving import (
    EngineClient,
    NodeDownError,
    RoutedResult,
    Router,
    RouterConfig,
    start_node,
)
from kvbridge.worker.tools import check_no_leaks, make_workload

MAX_TOKENS = 4
PROMPTS = make_workload(12, 3, 512, 16, seed=3)
EXTRA = ["--lease-ttl", "4", "--load-timeout", "3"]


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_router_config_names_the_bad_knob() -> None:
    from kvbridge.proto import ConfigError

    with pytest.raises(ConfigError, match="attempts must be >= 1"):
        RouterConfig(attempts=0)
    with pytest.raises(ConfigError, match="attempt_timeout_s must be > 0"):
        RouterConfig(attempt_timeout_s=0)
    with pytest.raises(ConfigError, match="at least one decode node"):
        Router(EngineClient(_closed_port()), [])


def test_no_reachable_node_fails_fast_naming_every_attempt() -> None:
    nodes = [EngineClient(_closed_port()) for _ in range(2)]
    router = Router(nodes, nodes, RouterConfig(attempts=3, attempt_timeout_s=5))
    t0 = time.monotonic()
    try:
        with pytest.raises(NodeDownError, match="no prefill node answered in 3 attempts") as err:
            router.generate([1, 2, 3], 2, "r")
        assert time.monotonic() - t0 < 10
        assert all(n.address in str(err.value) for n in nodes)
    finally:
        router.close()


@pytest.mark.slow
def test_spare_nodes_answer_every_request_while_nodes_hang_and_die(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    engine = Engine(EngineConfig.preset("tiny", num_blocks=128))
    expected = [engine.generate([p], MAX_TOKENS)[0] for p in PROMPTS]
    args = argparse.Namespace(
        model="tiny",
        block_size=16,
        num_blocks=128,
        seed=0,
        on_load_error="recompute",
        startup_timeout=90.0,
    )
    with ExitStack() as stack:
        procs, infos = {}, {}
        for name in ("p0", "p1", "d0", "d1"):
            role = "prefill" if name[0] == "p" else "decode"
            procs[name], infos[name] = stack.enter_context(
                start_node(name, args, "block-nhd", tmp_path, None, EXTRA, role=role)
            )
        clients = {n: EngineClient(i["inference"]) for n, i in infos.items()}
        router = Router(
            [clients["p0"], clients["p1"]],
            [clients["d0"], clients["d1"]],
            RouterConfig(attempts=2, attempt_timeout_s=4.0, down_s=30.0),
        )
        stack.callback(router.close)
        results: list[RoutedResult] = []

        def route(i: int) -> RoutedResult:
            res = router.generate(PROMPTS[i], MAX_TOKENS, f"r{i}")
            assert res.tokens == expected[i], f"request {i} differs"
            results.append(res)
            return res

        for i in range(4):  # round robin over every node, no faults
            assert route(i).retries == 0
        assert {r.decode_address for r in results} == {
            infos["d0"]["inference"],
            infos["d1"]["inference"],
        }

        # a hung prefill misses the per-attempt deadline; the other prefill answers
        os.kill(procs["p0"].pid, signal.SIGSTOP)
        res = route(4)
        assert res.retries == 1 and res.prefill_address == infos["p1"]["inference"]
        os.kill(procs["p0"].pid, signal.SIGCONT)

        # the decode round robin picks next hangs, then is killed while the request waits on it
        # (or just before it arrives)
        gone, spare = (
            ("d1", "d0") if res.decode_address == infos["d0"]["inference"] else ("d0", "d1")
        )
        os.kill(procs[gone].pid, signal.SIGSTOP)
        waiter = threading.Thread(target=route, args=(5,))
        waiter.start()
        time.sleep(1.0)
        procs[gone].kill()
        waiter.join(30)
        assert not waiter.is_alive()
        assert results[-1].retries == 1
        assert results[-1].decode_address == infos[spare]["inference"]

        # a killed prefill: marked down after one failed attempt, then skipped
        procs["p0"].kill()
        procs["p0"].wait()
        for i in range(6, 12):
            route(i)
        assert sum(r.retries for r in results[6:]) <= 1
        assert {r.prefill_address for r in results[6:]} == {infos["p1"]["inference"]}
        # p0's answer to the abandoned attempt left a lease, but p0 is gone; the rest is clean
        assert check_no_leaks({"p1": clients["p1"], spare: clients[spare]}, timeout_s=15) == []
        assert len(results) == 12


def test_a_node_restarted_on_the_same_port_is_served_at_once(tmp_path: Path) -> None:
    """The client's channel does not keep gRPC's reconnect backoff across a restart: the
    first call after the node is back (ready on a fresh connection) is served."""
    port = _closed_port().rpartition(":")[2]
    args = argparse.Namespace(
        model="tiny",
        block_size=16,
        num_blocks=64,
        seed=0,
        on_load_error="recompute",
        startup_timeout=90.0,
    )
    extra = ["--port", port]
    client = EngineClient(f"127.0.0.1:{port}", timeout_s=30.0)
    try:
        with start_node("d0", args, "block-nhd", tmp_path, None, extra, role="decode") as (p, _):
            assert client.generate(PROMPTS[0], 2, "before").token_ids
            p.kill()
            p.wait()
        for i in range(3):  # the node is gone: each call fails at once
            with pytest.raises(NodeDownError, match="UNAVAILABLE"):
                client.generate(PROMPTS[0], 2, f"down{i}")
            time.sleep(0.2)
        with start_node("d1", args, "block-nhd", tmp_path, None, extra, role="decode"):
            for i in range(2):  # two requests right after the restart, no retries
                assert client.generate(PROMPTS[1], 2, f"after{i}").token_ids
    finally:
        client.close()

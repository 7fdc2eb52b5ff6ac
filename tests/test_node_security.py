"""The serving node fails closed against forged, stale and hostile input (README "Security").

Real ``kvbridge serve`` processes on loopback with a shared token: a prefill
that peers reach through a proxy (which can make Release calls hang), a
decode that may dial only that proxy, and fake control servers that record
who called them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbridge.connector.control import ControlClient
from kvbridge.connector.params import MAX_ID_CHARS
from kvbridge.proto import AuthError, KVBridgeError, codec
from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving import EngineClient, Router, start_node
from kvbridge.worker.tools import check_no_leaks, make_workload
from tests.harness.grpc_fakes import HoldingProxy, RecordingServer

TOKEN = "n0de-t0ken"
MAX_TOKENS = 4
PROMPTS = make_workload(8, 8, 512, 16, seed=5)  # no two share a prefix: each one moves blocks


def reference(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Engine(EngineConfig.preset("tiny", num_blocks=64)).generate([prompt], max_tokens)[0]
    finally:
        torch.set_num_threads(threads)


def node_args() -> argparse.Namespace:
    return argparse.Namespace(
        model="tiny",
        block_size=16,
        num_blocks=256,
        seed=0,
        on_load_error="recompute",
        startup_timeout=120.0,
    )


@dataclass
class Nodes:
    prefill: EngineClient
    decode: EngineClient
    router: Router
    proxy: HoldingProxy
    recorder: RecordingServer
    info: dict[str, dict[str, str]]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    tmp = tmp_path_factory.mktemp("security")
    ttl = ["--lease-ttl", "4", "--load-timeout", "2"]
    with ExitStack() as stack:
        proxy = stack.enter_context(HoldingProxy())
        recorder = stack.enter_context(RecordingServer())
        args = node_args()
        _, pinfo = stack.enter_context(
            start_node(
                "prefill",
                args,
                "block-nhd",
                tmp,
                None,
                ["--advertise", proxy.address, "--max-lease-ttl", "10", *ttl],
                token=TOKEN,
            )
        )
        proxy.target = pinfo["control"]
        _, dinfo = stack.enter_context(
            start_node(
                "decode",
                args,
                "block-nhd",
                tmp,
                None,
                ["--allow-peer", proxy.address, *ttl],
                token=TOKEN,
            )
        )
        prefill = EngineClient(pinfo["inference"], timeout_s=60, token=TOKEN)
        decode = EngineClient(dinfo["inference"], timeout_s=60, token=TOKEN)
        stack.callback(prefill.close)
        stack.callback(decode.close)
        yield Nodes(
            prefill,
            decode,
            Router(prefill, decode),
            proxy,
            recorder,
            {"prefill": pinfo, "decode": dinfo},
        )
        assert check_no_leaks({"prefill": prefill, "decode": decode}, timeout_s=20) == []


pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------ Inference port auth


@pytest.mark.parametrize("node", ["prefill", "decode"])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_inference_callers_without_the_token_are_refused_and_learn_nothing(
    nodes: Nodes, node: str, token: str | None
) -> None:
    stranger = EngineClient(nodes.info[node]["inference"], timeout_s=10, token=token)
    try:
        with pytest.raises(KVBridgeError, match="UNAUTHENTICATED") as info:
            stranger.generate(PROMPTS[0], 2, "stranger", {"do_remote_decode": True})
        assert nodes.info[node]["engine_id"] not in str(info.value)
        with pytest.raises(KVBridgeError, match="UNAUTHENTICATED"):
            stranger.stats()
    finally:
        stranger.close()
    stats = nodes.prefill.stats()  # nothing ran, nothing is pinned
    assert stats.running_requests == 0 and stats.active_leases == 0


def test_routed_requests_with_the_token_decode_from_prefill_kv(nodes: Nodes) -> None:
    res = nodes.router.generate(PROMPTS[1], MAX_TOKENS, "ok")
    assert res.tokens == reference(PROMPTS[1])
    assert res.decode.blocks_moved > 0 and not res.decode.load_error


# ------------------------------------------------------------------------ control allowlist


def test_decode_never_dials_a_control_address_it_was_not_allowed(nodes: Nodes) -> None:
    prompt = PROMPTS[2]
    first = nodes.prefill.generate(prompt, 1, "forged", {"do_remote_decode": True})
    params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
    # an attacker's address (and a new engine id, so no existing link is reused)
    params.update(remote_address=nodes.recorder.address, remote_engine_id="attacker")
    rest = nodes.decode.generate(prompt + list(first.token_ids), MAX_TOKENS - 1, "forged", params)
    assert list(first.token_ids) + list(rest.token_ids) == reference(prompt)
    assert rest.stats.blocks_moved == 0 and rest.stats.blocks_recomputed > 0
    assert "not in the allowed peers" in rest.stats.load_error
    assert nodes.recorder.calls == []  # never contacted: the token never left
    assert check_no_leaks({"prefill": nodes.prefill}) == []  # its lease expired unread


# ------------------------------------------------------------------------------------- edges


def test_an_overlong_request_id_is_rejected_at_the_inference_edge(nodes: Nodes) -> None:
    with pytest.raises(KVBridgeError, match=rf"INVALID_ARGUMENT.*at most {MAX_ID_CHARS}"):
        nodes.prefill.generate(PROMPTS[3], 1, "r" * (MAX_ID_CHARS + 1), {"do_remote_decode": True})
    assert nodes.prefill.stats().active_leases == 0


def test_a_request_without_a_decode_hop_holds_no_lease(nodes: Nodes) -> None:
    assert check_no_leaks({"prefill": nodes.prefill}) == []
    res = nodes.router.generate(PROMPTS[4], 1, "one-token")
    assert res.tokens == reference(PROMPTS[4], 1)
    assert nodes.prefill.stats().active_leases == 0


def test_a_peer_asking_for_a_long_lease_gets_at_most_max_lease_ttl(nodes: Nodes) -> None:
    nodes.prefill.generate(PROMPTS[5], 1, "long-lease", {"do_remote_decode": True})
    with ControlClient(nodes.proxy.address, token=TOKEN) as client:
        lease = client.pin_request("long-lease", ttl_s=3600)  # type: ignore[arg-type]
        assert lease.lease_id is not None
        assert 0 < lease.expires_in_s <= 10.0
        assert client.release(lease.lease_id)
    with ControlClient(nodes.info["prefill"]["control"]) as stranger, pytest.raises(AuthError):
        stranger.health()  # the control port takes the same token


def test_a_release_the_peer_never_answers_does_not_delay_the_answer(nodes: Nodes) -> None:
    nodes.proxy.hold_releases.set()
    try:
        res = nodes.router.generate(PROMPTS[6], MAX_TOKENS, "held-release")
    finally:
        nodes.proxy.hold_releases.clear()
    assert res.tokens == reference(PROMPTS[6])
    assert res.decode.blocks_moved > 0  # it read from prefill, so a release was due
    # a sealed load gives the lease back by NIXL notification: no Release RPC at all, so a
    # control plane that holds releases cannot delay the answer (before: the whole 5 s
    # control deadline)
    assert res.total_ms - res.ttft_ms < 3000
    assert nodes.proxy.held == 0
    deadline = time.monotonic() + 5
    while nodes.prefill.stats().active_leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert nodes.prefill.stats().active_leases == 0, "the notification released the lease"


# -------------------------------------------------------------------------- all or nothing


HALF_BUILT_NODE = """
import json, socket, sys, threading, time
from kvbridge.connector import ServerOptions
from kvbridge.connector.config import ConnectorConfig
from kvbridge.worker.engine import EngineConfig
from kvbridge.worker.serving.node import Node, NodeConfig

def ours():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("kvb-", "kvbridge-")))

before = ours()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    control_port = s.getsockname()[1]
with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    config = NodeConfig(
        engine=EngineConfig.preset("tiny", num_blocks=32),
        connector=ConnectorConfig("half-built", role="prefill"),
        listen=ServerOptions(port=taken.getsockname()[1]),
        control_port=control_port,
    )
    try:
        Node(config)
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
deadline = time.monotonic() + 10
while ours() != before and time.monotonic() < deadline:
    time.sleep(0.05)
with socket.socket() as again:
    try:
        again.bind(("127.0.0.1", control_port))
        port_free = True
    except OSError:
        port_free = False
left = sorted(set(ours()) - set(before))
print(json.dumps({"error": error, "left": left, "port_free": port_free}))
"""


def test_a_node_that_fails_to_start_closes_what_it_built() -> None:
    # in a child process: what a half-built node leaves behind must not leak into this one
    out = subprocess.run(
        [sys.executable, "-c", HALF_BUILT_NODE], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"].startswith("ConfigError: cannot listen")
    assert result["left"] == []  # no engine thread, control server reaper or NIXL thread
    assert result["port_free"]  # the control server's port is free again


# ------------------------------------------------------------------------------------- TLS


def test_tls_nodes_serve_only_tls_and_decode_reads_prefill_over_it(
    tls_files: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = tls_files
    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    args = node_args()
    with ExitStack() as stack:
        _, pinfo = stack.enter_context(
            start_node("prefill", args, "block-nhd", tmp_path, None, tls, token=TOKEN)
        )
        _, dinfo = stack.enter_context(
            start_node("decode", args, "block-nhd", tmp_path, None, tls, token=TOKEN)
        )
        root = cert.read_bytes()
        clients: dict[str, Any] = {
            name: EngineClient(info["inference"], timeout_s=60, token=TOKEN, root_cert=root)
            for name, info in (("prefill", pinfo), ("decode", dinfo))
        }
        for client in clients.values():
            stack.callback(client.close)
        res = Router(clients["prefill"], clients["decode"]).generate(PROMPTS[7], MAX_TOKENS, "t")
        assert res.tokens == reference(PROMPTS[7])
        assert res.decode.blocks_moved > 0  # decode dialed prefill's control port over TLS
        plain = EngineClient(pinfo["inference"], timeout_s=5, token=TOKEN)
        stack.callback(plain.close)
        with pytest.raises(KVBridgeError, match="UNAVAILABLE"):
            plain.stats()
        assert check_no_leaks(clients) == []

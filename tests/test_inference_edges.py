"""Edges of the serving node's Inference API: idle connections, request ids, tiny blocks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connector import ConnectorConfig
from kvbridge.connector.params import MAX_ID_CHARS
from kvbridge.proto import ConfigError, WireError
from kvbridge.worker.engine import EngineConfig
from kvbridge.worker.serving import EngineClient
from kvbridge.worker.serving.inference import check_request_id
from kvbridge.worker.tools import make_workload


def test_the_demo_workload_exists_for_one_token_blocks() -> None:
    prompts = make_workload(6, 2, 512, block_size=1, seed=3)  # `kvbridge demo --block-size 1`
    assert len(prompts) == 6 and all(len(p) >= 5 for p in prompts)


def test_request_ids_are_bounded_and_printable() -> None:
    assert check_request_id("r" * MAX_ID_CHARS) == "r" * MAX_ID_CHARS
    with pytest.raises(WireError, match=f"at most {MAX_ID_CHARS}"):
        check_request_id("r" * (MAX_ID_CHARS + 1))
    with pytest.raises(WireError, match="printable"):
        check_request_id("r\x1b[2J")


class StatsOnlyNode:
    """Stands in for a Node behind the Inference servicer: answers EngineStats only."""

    def __init__(self) -> None:
        from kvbridge.proto import engine_pb2 as epb

        self._stats = epb.EngineStatsResponse(engine_id="idle-test")

    def stats(self) -> Any:
        return self._stats


def test_the_inference_port_disconnects_idle_clients() -> None:
    import grpc

    from kvbridge.connector.control.grpc_server import bind
    from kvbridge.worker.serving import NodeConfig
    from kvbridge.worker.serving.inference import InferenceServicer, inference_server

    config = NodeConfig(
        engine=EngineConfig.preset("tiny", num_blocks=8),
        connector=ConnectorConfig("idle-test"),
        max_connection_idle_s=1.0,
    )
    server = inference_server(
        InferenceServicer(StatsOnlyNode(), config.request_timeout_s),  # type: ignore[arg-type]
        options=config.listen,
        max_connection_idle_s=config.max_connection_idle_s,
        max_concurrent_requests=config.max_concurrent_requests,
    )
    port = bind(server, config.listen)
    server.start()
    states: list[grpc.ChannelConnectivity] = []
    client = EngineClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        assert client.stats().engine_id == "idle-test"
        client._channel.subscribe(states.append)
        deadline = time.monotonic() + 10
        while grpc.ChannelConnectivity.IDLE not in states and time.monotonic() < deadline:
            time.sleep(0.1)
        assert grpc.ChannelConnectivity.IDLE in states  # the server let the connection go
        assert client.stats().engine_id == "idle-test"  # and a new call reconnects
    finally:
        client.close()
        server.stop(0).wait()


def serve_args(*argv: str) -> Any:
    import argparse

    from kvbridge.worker.serving import node_cmd

    parser = argparse.ArgumentParser()
    node_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_reads_the_token_file_and_trusts_its_own_certificate_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvbridge.worker.server_auth import read_auth

    (tmp_path / "token").write_text("from-a-file\n")
    (tmp_path / "cert.pem").write_bytes(b"CERT")
    (tmp_path / "key.pem").write_bytes(b"KEY")
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    got = read_auth(serve_args("--token-file", str(tmp_path / "token"), *tls))
    assert (got.token, got.tls_cert, got.tls_key, got.tls_root_cert) == (
        "from-a-file",
        b"CERT",
        b"KEY",
        b"CERT",
    )
    monkeypatch.setenv("KVBRIDGE_TOKEN", "from-env")
    args = serve_args("--allow-peer", "10.0.0.1:7001", "--allow-peer", "10.0.0.2:7001")
    assert read_auth(args).token == "from-env"
    assert args.allow_peer == ["10.0.0.1:7001", "10.0.0.2:7001"]
    with pytest.raises(ConfigError, match="--tls-key"):
        read_auth(serve_args("--tls-cert", str(tmp_path / "cert.pem")))


def test_a_prefill_listening_on_every_interface_must_say_where_peers_reach_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvbridge.worker.cli import main

    code = main(["serve", "--role", "prefill", "--host", "0.0.0.0", "--model", "tiny"])
    assert code == 2
    assert "--advertise HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["Generate", "EngineStats"])
def test_a_malformed_inference_request_is_invalid_argument(method: str) -> None:
    import grpc

    from kvbridge.connector.control.grpc_server import bind
    from kvbridge.worker.serving import NodeConfig
    from kvbridge.worker.serving.inference import InferenceServicer, inference_server

    config = NodeConfig(
        engine=EngineConfig.preset("tiny", num_blocks=8), connector=ConnectorConfig("bad-bytes")
    )
    node = StatsOnlyNode()
    server = inference_server(
        InferenceServicer(node, config.request_timeout_s),  # type: ignore[arg-type]
        options=config.listen,
        max_connection_idle_s=config.max_connection_idle_s,
        max_concurrent_requests=config.max_concurrent_requests,
    )
    port = bind(server, config.listen)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/kvbridge.proto.Inference/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\xff\xff\xff", timeout=5)  # not a protobuf message
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed" in (info.value.details() or "")
        assert EngineClient(f"127.0.0.1:{port}").stats().engine_id == "idle-test"
    finally:
        server.stop(0).wait()

"""Committed stubs match the generator; light imports; the bare control server and its bench."""

from __future__ import annotations

import argparse
import filecmp
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.connector.control import ControlClient, PeerInfo, Role
from kvbridge.proto import AuthError, EngineId, TransferMode, preset_layout
from kvbridge.worker import ChildProcess, listening_on
from tests.harness.fresh import run_python

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"


def test_committed_stubs_match_a_fresh_regeneration(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="needs the dev extra (grpcio-tools)")
    from kvbridge.proto.generate import generate, generated_names

    try:
        generate(tmp_path, PROTO_DIR)
    except RuntimeError as exc:
        if "not found" in str(exc):
            pytest.skip(str(exc))
        raise
    names = generated_names(PROTO_DIR)
    assert "control_pb2.py" in names and "control_pb2_grpc.pyi" in names
    stale = [n for n in names if not (PROTO_DIR / n).exists() or not filecmp.cmp(
        tmp_path / n, PROTO_DIR / n, shallow=False
    )]  # fmt: skip
    assert stale == [], f"run `python -m kvbridge.proto.generate` and commit: {stale}"


def test_generated_code_imports_package_qualified_and_wire_types_load_no_grpc() -> None:
    code = (
        "import sys, kvbridge.proto, kvbridge.connector;"
        "import kvbridge.proto.control_pb2 as pb, kvbridge.connector.control.types;"
        "assert pb.DESCRIPTOR.name == 'kvbridge/proto/control.proto', pb.DESCRIPTOR.name;"
        "print([m for m in sys.modules if m.split('.')[0] == 'grpc'])"
    )
    out = run_python(code)
    assert out.strip() == "[]"


def run_serve(*args: str) -> ChildProcess:
    return ChildProcess(
        [sys.executable, "-m", "kvbridge.worker.serving.control_cmd", *args],
        name="serve-control",
        ready=listening_on,
        env={"PYTHONUNBUFFERED": "1"},
    )


def test_serve_control_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.serving.control_cmd", "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0
    assert "--tls-cert" in out.stdout and "--token-file" in out.stdout


def test_a_served_control_plane_answers_health_from_another_process(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    with run_serve(
        "--preset", "tiny", "--engine-id", "p-cli", "--token-file", str(token_file)
    ) as proc:
        address = proc.wait_ready()["address"]
        with ControlClient(address, token="t0ken") as client:
            health = client.health()
            assert (health.engine_id, health.role) == ("p-cli", Role.PREFILL)
            me = PeerInfo(EngineId("d"), Role.DECODE, preset_layout("tiny", order="layer-nhd"))
            assert client.handshake(me).negotiation.mode is TransferMode.PER_SPAN
        with ControlClient(address) as stranger, pytest.raises(AuthError):
            stranger.health()
        proc.send_signal(signal.SIGINT)
        # shutdown drains gRPC and the lease reaper: seconds when idle, more on a loaded CI box
        assert proc.wait(timeout=30) == 0


def test_bench_control_writes_latency_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvbridge.worker.bench import control as bench_control

    parser = argparse.ArgumentParser()
    bench_control.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["control", "--preset", "tiny", "--blocks", "8", "--iterations", "30", "--warmup", "5",
         "--in-process", "--token", "t", "--out", str(tmp_path / "c")]
    )  # fmt: skip
    assert args.func(args) == 0
    assert "Pin+Release of 8 blocks: p50" in capsys.readouterr().out
    body = json.loads((tmp_path / "c.json").read_text())
    ops = {r["operation"] for r in body["rows"]}
    assert ops == {"Health", "Handshake", "Heartbeat", "Pin+Release"}
    assert all(r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in body["rows"])

"""The command-line and config knobs that put kvbridge's KV on a GPU: checked on any machine
(refused cleanly without CUDA), exercised for real on a CUDA machine (marked ``gpu``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvbridge.connector import ConnectorConfig
from kvbridge.proto import ConfigError
from kvbridge.worker.bench.transfer_peer import copy_gbps
from kvbridge.worker.cli import build_parser, main
from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving import NodeConfig
from kvbridge.worker.serving.node_cmd import engine_model_flags

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")


def _sub(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def test_node_config_takes_cpu_or_cuda_devices_only() -> None:
    base = {"engine": EngineConfig.preset("tiny", num_blocks=8), "connector": ConnectorConfig("x")}
    for ok in ("cpu", "cuda", "cuda:1"):
        assert NodeConfig(**base, device=ok).device == ok  # type: ignore[arg-type]
    for bad in ("gpu", "cuda:", "cuda:x", "mps", ""):
        with pytest.raises(ConfigError, match="must be cpu, cuda or cuda:N"):
            NodeConfig(**base, device=bad)  # type: ignore[arg-type]


def test_demo_passes_its_device_to_the_nodes_it_starts() -> None:
    args = _sub(build_parser(), "demo").parse_args(["--device", "cuda"])
    assert args.device == "cuda"
    assert engine_model_flags(args)[-2:] == ["--device", "cuda"]
    assert "--device" not in engine_model_flags(_sub(build_parser(), "demo").parse_args([]))
    assert _sub(build_parser(), "serve").parse_args(["--device", "cuda:0"]).device == "cuda:0"


def test_bench_transfer_takes_a_device_per_side() -> None:
    args = _sub(build_parser(), "bench", "transfer").parse_args(
        ["--target-device", "cpu", "--reader-device", "cuda"]
    )
    assert (args.target_device, args.reader_device) == ("cpu", "cuda")
    assert _sub(build_parser(), "bench", "transfer").parse_args([]).reader_device == "cpu"


@no_cuda
def test_bench_transfer_on_cuda_is_refused_without_a_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "transfer", "--reader-device", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "kvbridge bench transfer: error: --reader-device cuda needs a CUDA device" in err


def test_the_reference_copy_of_the_transfer_bench_runs_on_the_host() -> None:
    assert copy_gbps(1 << 20, 2, "cpu", "cpu") > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("src", "dst"), [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_the_reference_copies_run_between_host_and_gpu(src: str, dst: str) -> None:
    assert copy_gbps(16 << 20, 2, src, dst) > 0


@pytest.mark.gpu
@needs_cuda
def test_the_engine_runs_on_cuda_with_its_kv_in_vram() -> None:
    engine = Engine(EngineConfig.preset("tiny", num_blocks=32), device="cuda")
    assert all(t.is_cuda for t in engine.kv_caches.values())
    assert engine.layout.regions[0].device.startswith("cuda")
    out = engine.generate([[1, 2, 3, 4, 5] * 7], 6)
    assert len(out[0]) == 6

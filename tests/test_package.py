"""Packaging contracts: light imports, the CLI, README commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.fresh import assert_importing_loads_none_of, run_python

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_contract_loads_no_heavy_or_gpu_code() -> None:
    code = (
        "import sys, kvbridge.proto, kvbridge.connector, kvbridge.kernels;"
        "print([m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'nixl', 'nixl_cu12', 'nixl_cu13', 'grpc', 'cupy')])"
    )
    out = run_python(code)
    assert out.strip() == "[]"


def test_the_connector_config_loads_no_protobuf_or_grpc() -> None:
    """A config is built at the edge (CLI flags, vLLM's extra config) before any server."""
    assert_importing_loads_none_of(["kvbridge.connector.config"], ("google.protobuf", "grpc"))


def test_no_top_level_proto_or_kernels_module_is_installed() -> None:
    names = ("proto", "kernels", "connector", "worker")
    code = f"import importlib.util as u; print([n for n in {names} if u.find_spec(n)])"
    out = run_python(code, cwd="/")
    assert out.strip() == "[]"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.cli", *args], capture_output=True, text=True
    )


def test_layout_command_prints_both_orders_byte_math() -> None:
    out = run_cli("layout", "--preset", "llama3-8b")
    assert out.returncode == 0, out.stderr
    assert "block 2 MiB = 1 descriptor(s) of 2 MiB" in out.stdout
    assert "block 2 MiB = 64 descriptor(s) of 32 KiB" in out.stdout


def test_cli_errors_say_what_to_do() -> None:
    out = run_cli("layout", "--order", "B L")
    assert out.returncode == 2
    assert "use one of block-nhd" in out.stderr


@pytest.mark.parametrize("cmd", [[], ["layout"], ["bench"], ["bench", "hash"], ["version"]])
def test_every_command_has_help(cmd: list[str]) -> None:
    out = run_cli(*cmd, "--help")
    assert out.returncode == 0 and "usage:" in out.stdout


def test_bench_hash_writes_json_with_the_32k_figure(tmp_path: Path) -> None:
    out = run_cli("bench", "hash", "--repeats", "3", "--out", str(tmp_path / "h"))
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert {(r["algorithm"], r["tokens"]) for r in rows} >= {("sha256", 32768)}
    assert all(r["best_ms"] > 0 for r in rows)


def test_readme_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash .ci/run" in readme
    assert "pytest" in (ROOT / ".ci" / "run").read_text()


def test_dependencies_are_ranges_an_existing_vllm_environment_satisfies() -> None:
    """No exact torch pin (it would replace vLLM's torch) and no NIXL CUDA variant forced on
    everyone: NIXL comes through the cu12/cu13 extras (tests/test_vllm_install.py installs
    the wheel into a vLLM environment)."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0]: d for d in project["dependencies"]}
    assert re.fullmatch(r"torch>=[\d.]+", deps["torch"]), deps["torch"]
    assert not [d for d in deps if d.startswith("nixl")], deps
    assert all("==" not in d for d in deps.values()), deps
    extras = project["optional-dependencies"]
    assert [d.split(">=")[0] for d in extras["cu12"]] == ["nixl-cu12"]
    assert [d.split(">=")[0] for d in extras["cu13"]] == ["nixl-cu13"]
    # the tests run real NIXL agents (and ZMQ KV events)
    assert "kvbridge[cu12,events]" in extras["dev"]

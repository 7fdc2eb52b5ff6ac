"""Every ``kvbridge bench X`` shares one command-line shape: ``--out PREFIX`` (alias
``--json``) writing PREFIX.json and PREFIX.png, and no progress bar off a terminal."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from kvbridge.worker.bench.cli_args import output_paths
from kvbridge.worker.bench.report import progress
from kvbridge.worker.cli import build_parser

BENCHES = ["control", "hash", "kernels", "load", "offload", "prefill-skip", "transfer", "vllm"]


def bench_parser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    bench_sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    assert set(bench_sub.choices) == set(BENCHES), "a new bench needs its row here and in README"
    return bench_sub.choices[name]


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_defaults_to_results_bench_name(name: str) -> None:
    args = bench_parser(name).parse_args([])
    assert output_paths(args.out) == (
        Path(f"results/bench-{name}.json"),
        Path(f"results/bench-{name}.png"),
    )


@pytest.mark.parametrize("name", BENCHES)
@pytest.mark.parametrize("flag", ["--out", "--json"])
@pytest.mark.parametrize("given", ["runs/x", "runs/x.json", "runs/x.png"])
def test_out_and_json_name_the_same_prefix(name: str, flag: str, given: str) -> None:
    args = bench_parser(name).parse_args([flag, given])
    assert output_paths(args.out) == (Path("runs/x.json"), Path("runs/x.png"))


def test_a_dot_inside_the_prefix_is_kept() -> None:
    assert output_paths(Path("runs/v1.2")) == (Path("runs/v1.2.json"), Path("runs/v1.2.png"))


def test_progress_writes_nothing_when_stderr_is_not_a_terminal() -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        assert list(progress(range(3), "work", total=3)) == [0, 1, 2]
    assert err.getvalue() == ""


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal() -> None:
    err = _Terminal()
    with redirect_stderr(err):
        assert list(progress(range(3), "work", total=3)) == [0, 1, 2]
    assert "work" in err.getvalue()


def test_bench_hash_json_alias_writes_both_files(tmp_path: Path) -> None:
    prefix = tmp_path / "h"
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.cli", "bench", "hash", "--repeats", "1",
         "--tokens", "64", "--json", f"{prefix}.json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", "no progress or warnings on a non-terminal stderr"
    assert json.loads((tmp_path / "h.json").read_text())["rows"]
    assert (tmp_path / "h.png").exists()

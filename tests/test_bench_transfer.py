"""``kvbridge bench transfer`` runs end to end (two NIXL processes) and compares each READ,
repeat by repeat, with bare NIXL calls and with the one-region READ of the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_transfer_pairs_each_read_with_bare_nixl_and_one_region(tmp_path: Path) -> None:
    out = tmp_path / "transfer"
    cmd = [sys.executable, "-m", "kvbridge.worker.cli", "bench", "transfer", "--presets", "small"]
    done = subprocess.run(
        [*cmd, "--block-sizes", "16", "--transports", "default", "--mib", "4", "--repeats", "3",
         "--request-tokens", "256", "--latency-repeats", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert {(r["layout"], r["pattern"]) for r in rows} == {
        (kind, pattern)
        for kind in ("block-outermost", "layer-separate")
        for pattern in ("random", "sequential")
    }
    for r in rows:
        assert r["bare_nixl_gbps"] > 0 and r["vs_bare_nixl"] > 0 and r["vs_raw_paired"] > 0, r
    outermost = [r for r in rows if r["layout"] == "block-outermost"]
    assert all(r["descriptors_per_block"] == 1 for r in outermost)
    for ratio in report["ratios"]:
        assert ratio["outermost_vs_bare_nixl"] > 0 and ratio["outermost_vs_raw_paired"] > 0
    assert out.with_suffix(".png").stat().st_size > 0

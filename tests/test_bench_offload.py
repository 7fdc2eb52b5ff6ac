"""``kvbridge bench offload`` runs end to end (a real daemon) and reports verified and
unverified loads of the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_offload_reports_verified_and_unverified_loads_of_one_run(tmp_path: Path) -> None:
    out = tmp_path / "offload"
    cmd = [sys.executable, "-m", "kvbridge.worker.cli", "bench", "offload", "--presets", "small"]
    done = subprocess.run(
        [*cmd, "--block-sizes", "16", "--mib", "8", "--repeats", "2", "--lookup-repeats", "2",
         "--lookup-hashes", "100", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (row,) = report["rows"]
    assert row["load_gbps"] > 0 and row["load_unverified_gbps"] > 0 and row["verify_gbps"] > 0
    assert row["verified_over_unverified"] == pytest.approx(
        row["load_gbps"] / row["load_unverified_gbps"]
    )
    assert "verified" in report["settings"]["verify"]
    # CPU of raw NIXL over ours: the digest is CPU work, so a verified load costs more
    for key in ("store_cpu_vs_raw", "load_cpu_vs_raw", "load_unverified_cpu_vs_raw"):
        assert 0 < row[key] < 10, (key, row[key])
    assert "CPU: raw's over ours" in done.stdout
    assert report["settings"]["max_piece_mib"] == 64
    assert out.with_suffix(".png").stat().st_size > 0
    assert "verification costs" in done.stdout


def test_bench_offload_disk_rows_compare_the_tier_with_plain_file_io(tmp_path: Path) -> None:
    out = tmp_path / "offload"
    cmd = [sys.executable, "-m", "kvbridge.worker.cli", "bench", "offload", "--presets", "small"]
    done = subprocess.run(
        [*cmd, "--block-sizes", "16", "--mib", "4", "--repeats", "2", "--lookup-repeats", "2",
         "--lookup-hashes", "100", "--disk", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (row,) = report["disk_rows"]
    for key in ("demote_gbps", "promote_gbps", "plain_write_gbps", "plain_read_gbps"):
        assert row[key] > 0, row
    assert row["demote_over_write"] == pytest.approx(row["demote_gbps"] / row["plain_write_gbps"])
    assert row["blocks"] == 32 and isinstance(row["cache_dropped"], bool)
    assert (tmp_path / "offload-disk.png").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvbridge-bench")] == []

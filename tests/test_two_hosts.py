"""The cross-node path for real: prefill and decode in two network namespaces over TCP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "netns_two_hosts.py"


@pytest.mark.slow
@pytest.mark.netns
def test_prefill_and_decode_in_two_network_namespaces_match_single_process(tmp_path: Path) -> None:
    out = tmp_path / "two_hosts.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--requests", "6", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 77:
        pytest.skip(f"network namespaces unavailable: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["all_match"] and summary["blocks_moved"] > 0 and summary["leaks"] == []
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvb-" not in left, "the example must remove its namespaces"

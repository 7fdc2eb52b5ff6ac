"""``kvbridge bench vllm`` end to end: one round, two tiny prompts, the 4-layer model, both
connectors in real vLLM; the JSON has its schema and every request's KV was loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.vllm import model_or_skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.extended,
    pytest.mark.timeout(600),
]


def test_one_round_of_both_connectors_loads_every_request(tmp_path: Path) -> None:
    model_or_skip(tmp_path)  # builds .venv-vllm or skips
    prefix = tmp_path / "out" / "bench"
    port = 19000 + os.getpid() % 2000
    cmd = [sys.executable, "-m", "kvbridge.worker.cli", "bench", "vllm", "--rounds", "1",
           "--requests", "1", "--models", "4L", "--short", "40", "80", "--long", "100", "140",
           "--port", str(port), "--work", str(tmp_path / "work"), "--out", str(prefix)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "round 1/1: 4L nixl" in out.stderr  # progress lines
    payload = json.loads(prefix.with_suffix(".json").read_text())
    assert payload["trustworthy"] and payload["problems"] == []
    assert {"machine", "settings", "summary", "ratios", "rounds", "requests"} <= set(payload)
    assert payload["settings"]["nproc"] >= 1
    rounds = payload["rounds"]
    assert [(r["connector"], r["round"]) for r in rounds] == [("kvbridge", 0), ("nixl", 0)]
    for r in rounds:
        assert len(r["loadavg_before"]) == 3 and len(r["loadavg_after"]) == 3
        assert r["blocks_held_after"] == {"prefill": 0, "decode": 0}
    requests = payload["requests"]
    assert sorted((r["connector"], r["prompts"]) for r in requests) == [
        ("kvbridge", "long"),
        ("kvbridge", "short"),
        ("nixl", "long"),
        ("nixl", "short"),
    ]
    assert payload["settings"]["max_model_len"] > max(r["prompt_tokens"] for r in requests)
    for r in requests:
        assert r["loaded"] and r["same_first_token"] and r["error"] is None, r
        assert 0 < r["transfer_ms"] < r["decode_ttft_ms"] < r["e2e_ms"], r
        # NIXL's telemetry of the READ: inside kvbridge's whole load, NixlConnector's own figure
        assert 0 < r["read_ms"] <= r["transfer_ms"], r
        assert 0 < r["wire_descriptors"] <= r["descriptors"], r
    assert 40 <= min(r["prompt_tokens"] for r in requests if r["prompts"] == "short") <= 80
    assert len(payload["summary"]) == 4
    assert {(s["prompts"]) for s in payload["ratios"]} == {"short", "long"}
    for s in payload["summary"]:
        assert s["decode_ttft_ms"]["n"] == 1 and len(s["decode_ttft_ms"]["round_medians"]) == 1
    assert prefix.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"

"""The offload daemon inside P/D: real daemon, prefill and decode processes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.worker.serving import EngineClient, Router, start_node, start_offload_daemon
from kvbridge.worker.tools import check_no_leaks, make_workload
from tests.harness.nodes import node_args, reference
from tests.harness.offload import start_workers

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
PROMPTS = make_workload(4, 2, 512, 16, seed=3)
EXPECTED = reference(PROMPTS, MAX_TOKENS)


def _route(
    prefill: EngineClient, decode_info: dict[str, str], tag: str
) -> list[tuple[int, int, int]]:
    decode = EngineClient(decode_info["inference"], timeout_s=60)
    router = Router(prefill, decode)
    counts = []
    for i, prompt in enumerate(PROMPTS):
        res = router.generate(prompt, MAX_TOKENS, f"{tag}-{i}")
        assert res.tokens == EXPECTED[i], f"{tag} request {i} differs"
        assert not res.decode.load_error
        d = res.decode
        counts.append((d.blocks_offloaded, d.blocks_moved, d.blocks_local_hit))
    assert check_no_leaks({"prefill": prefill, "decode": decode}) == []
    decode.close()
    return counts


def test_a_fresh_decode_node_loads_repeated_prompts_from_the_daemon(tmp_path: Path) -> None:
    args = node_args()
    with start_offload_daemon(tmp_path, 60) as daemon:
        extra = ["--offload", daemon.address]
        with start_node("prefill", args, "block-nhd", tmp_path, None, extra) as (_, pinfo):
            prefill = EngineClient(pinfo["inference"], timeout_s=60)
            with start_node("d1", args, "block-nhd", tmp_path, None, extra, role="decode") as (
                _,
                d1,
            ):
                _route(prefill, d1, "first")
            with start_node("d2", args, "layer-nhd", tmp_path, None, extra, role="decode") as (
                _,
                d2,
            ):
                second = _route(prefill, d2, "second")
            prefill.close()
    # the fresh node finds every full prompt block in its own cache (prompts it already
    # served) or in the daemon; only partial blocks still come from prefill's memory
    for (offloaded, moved, hit), prompt in zip(second, PROMPTS, strict=True):
        assert offloaded + hit == len(prompt) // 16
        assert moved == (1 if len(prompt) % 16 else 0)
    assert second[0][0] == len(PROMPTS[0]) // 16 > 0


def test_an_unreachable_daemon_is_a_cache_miss_not_an_error(tmp_path: Path) -> None:
    args: argparse.Namespace = node_args()
    extra = ["--offload", "127.0.0.1:9"]  # nothing listens there
    with (
        start_node("prefill", args, "block-nhd", tmp_path, None, extra) as (_, pinfo),
        start_node("decode", args, "block-nhd", tmp_path, None, extra) as (_, dinfo),
    ):
        prefill = EngineClient(pinfo["inference"], timeout_s=60)
        counts = _route(prefill, dinfo, "nodaemon")
        prefill.close()
    assert all(offloaded == 0 for offloaded, _, _ in counts)


def test_a_decode_in_another_order_loads_from_the_daemon_in_the_demo(tmp_path: Path) -> None:
    """`kvbridge demo --offload --decode-order layer-hnd`: the second pass's fresh decode
    (HND inner order, against a pool in prefill's NHD) loads from the daemon through its
    staging cache, every token right."""
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "kvbridge.worker.cli", "demo", "--offload", "--decode-order"]
    done = subprocess.run(
        [*cmd, "layer-hnd", "--requests", "6", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["all_match"] and summary["leaks"] == []
    second = [r for r in report["requests"] if r["pass"] == 2]
    assert sum(r["blocks_offloaded"] for r in second) > 0, summary


def test_junk_written_into_the_daemons_blocks_is_caught_and_tokens_stay_right(
    tmp_path: Path,
) -> None:
    """A token holder WRITEs junk over every slot of the daemon's pool after prefill stored
    the prompts: a fresh decode (in another inner order, so through staging) finds every
    offloaded block failing its digest, reads or recomputes them instead, and decodes the
    same tokens; the per-request stats and the daemon count the bad blocks."""
    args = node_args()
    (attacker,) = start_workers("junk-writer")
    try:
        with start_offload_daemon(tmp_path, 60, capacity="4MiB") as daemon:
            extra = ["--offload", daemon.address]
            with start_node("prefill", args, "block-nhd", tmp_path, None, extra) as (_, pinfo):
                prefill = EngineClient(pinfo["inference"], timeout_s=60)
                with start_node("d1", args, "block-nhd", tmp_path, None, extra, role="decode") as (
                    _,
                    d1,
                ):
                    _route(prefill, d1, "first")
                attacker.call(
                    "setup",
                    address=daemon.address,
                    preset="tiny",
                    num_blocks=32,
                    order="block-nhd",
                    seed=9,
                    engine_model="tiny",
                )
                stats = attacker.call("stats")["stats"]
                assert stats["stored_blocks"] > 0
                slots = list(range(stats["capacity_blocks"]))
                for a in range(0, len(slots), 32):
                    part = slots[a : a + 32]
                    attacker.call("write_slots", ids=list(range(len(part))), slots=part)
                with start_node("d2", args, "layer-hnd", tmp_path, None, extra, role="decode") as (
                    _,
                    d2,
                ):
                    decode = EngineClient(d2["inference"], timeout_s=60)
                    router = Router(prefill, decode)
                    bad = 0
                    for i, prompt in enumerate(PROMPTS):
                        res = router.generate(prompt, MAX_TOKENS, f"junk-{i}")
                        assert res.tokens == EXPECTED[i], f"request {i} differs"
                        assert res.decode.blocks_offloaded == 0
                        bad += res.decode.offload_bad_digest
                    assert check_no_leaks({"prefill": prefill, "decode": decode}) == []
                    decode.close()
                prefill.close()
                assert bad > 0
                stats = attacker.call("stats")["stats"]
                assert stats["bad_digest_blocks"] > 0
                assert stats["bad_digest_reports"] == bad
                attacker.call("close")
    finally:
        attacker.stop()

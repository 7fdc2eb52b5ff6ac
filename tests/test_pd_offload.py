"""The offload daemon inside P/D: real daemon, prefill and decode processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvbridge.worker.serving import (
    EngineClient,
    Router,
    check_no_leaks,
    make_workload,
    start_node,
    start_offload_daemon,
)
from tests.harness.nodes import node_args, reference

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

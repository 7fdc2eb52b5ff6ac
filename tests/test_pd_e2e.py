"""Prefill/decode end to end: real nodes in separate processes, real NIXL, real gRPC.

Outputs are compared token for token with a single-process engine; pools and
leases are checked back to full/empty after every scenario.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbridge.proto import codec
from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving.demo import check_no_leaks, make_workload, start_node
from kvbridge.worker.serving.router import EngineClient, Router

pytestmark = pytest.mark.slow

MAX_TOKENS = 6


def node_args(**overrides: Any) -> argparse.Namespace:
    base = dict(
        model="tiny",
        block_size=16,
        num_blocks=256,
        seed=0,
        on_load_error="recompute",
        startup_timeout=90.0,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


class Pair:
    """A prefill and a decode node plus a router; ``close`` stops both processes."""

    def __init__(
        self,
        tmp: Path,
        prefill_order: str,
        decode_order: str,
        prefill_extra: list[str] | None = None,
        decode_extra: list[str] | None = None,
        **overrides: Any,
    ) -> None:
        self.args = node_args(**overrides)
        self._stack = ExitStack()
        self.prefill_proc, pinfo = self._stack.enter_context(
            start_node("prefill", self.args, prefill_order, tmp, None, prefill_extra)
        )
        self.decode_proc, dinfo = self._stack.enter_context(
            start_node("decode", self.args, decode_order, tmp, None, decode_extra)
        )
        self.prefill = EngineClient(pinfo["inference"], timeout_s=60)
        self.decode = EngineClient(dinfo["inference"], timeout_s=60)
        self.router = Router(self.prefill, self.decode)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self._stack.close()


def reference(prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    torch.set_num_threads(1)
    engine = Engine(EngineConfig.preset("tiny", num_blocks=256))
    return [engine.generate([p], max_tokens)[0] for p in prompts]


PROMPTS = make_workload(8, 2, 512, 16, seed=1)
EXPECTED = reference(PROMPTS)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


@pytest.mark.parametrize(
    ("prefill_order", "decode_order"),
    [
        ("block-nhd", "block-nhd"),
        ("layer-nhd", "layer-nhd"),
        ("block-nhd", "layer-kv-nhd"),
        ("layer-hnd", "block-nhd"),
    ],
)
def test_decode_continues_exactly_where_prefill_left_off(
    tmp: Path, prefill_order: str, decode_order: str
) -> None:
    pair = Pair(tmp, prefill_order, decode_order)
    try:
        moved = []
        for i, prompt in enumerate(PROMPTS):
            res = pair.router.generate(prompt, MAX_TOKENS, f"r{i}")
            assert res.tokens == EXPECTED[i], f"request {i} differs"
            assert not res.decode.load_error
            assert res.decode.blocks_recomputed == 0
            moved.append((res.decode.blocks_local_hit, res.decode.blocks_moved))
        # the second request with each prefix finds the prefix in decode's own cache
        assert moved[0][0] == 0 and moved[2][0] > 0
        assert moved[2][1] < moved[0][1] + moved[2][0]
        assert check_no_leaks({"prefill": pair.prefill, "decode": pair.decode}) == []
    finally:
        pair.close()


def test_killed_prefill_makes_pending_requests_recompute_and_others_succeed(tmp: Path) -> None:
    pair = Pair(tmp, "block-nhd", "block-nhd")
    try:
        ok = pair.router.generate(PROMPTS[0], MAX_TOKENS, "before")
        assert ok.tokens == EXPECTED[0] and ok.decode.blocks_moved > 0
        # prefill answers, then dies before decode reads its blocks
        firsts = [
            pair.prefill.generate(p, 1, f"p{i}", {"do_remote_decode": True})
            for i, p in enumerate(PROMPTS[1:4], 1)
        ]
        pair.prefill_proc.kill()
        pair.prefill_proc.wait()
        for i, first in enumerate(firsts, 1):
            params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
            rest = pair.decode.generate(
                PROMPTS[i] + list(first.token_ids), MAX_TOKENS - 1, f"p{i}", params
            )
            assert list(first.token_ids) + list(rest.token_ids) == EXPECTED[i]
            assert rest.stats.load_error, "a failed load must be reported"
            assert rest.stats.blocks_moved == 0 and rest.stats.blocks_recomputed > 0
        assert check_no_leaks({"decode": pair.decode}) == []
    finally:
        pair.close()


def test_on_load_error_fail_returns_a_clear_error(tmp: Path) -> None:
    pair = Pair(tmp, "block-nhd", "block-nhd", on_load_error="fail")
    try:
        first = pair.prefill.generate(PROMPTS[0], 1, "x", {"do_remote_decode": True})
        pair.prefill_proc.kill()
        pair.prefill_proc.wait()
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        from kvbridge.proto import KVBridgeError

        with pytest.raises(KVBridgeError, match=r"KV load failed .* --on-load-error is 'fail'"):
            pair.decode.generate(PROMPTS[0] + list(first.token_ids), MAX_TOKENS - 1, "x", params)
        assert check_no_leaks({"decode": pair.decode}) == []
    finally:
        pair.close()


def test_expired_lease_is_re_pinned_by_hash_and_only_the_partial_block_recomputed(
    tmp: Path,
) -> None:
    extra = ["--lease-ttl", "1.0", "--load-timeout", "0.9"]
    pair = Pair(tmp, "block-nhd", "block-nhd", prefill_extra=extra, decode_extra=extra)
    try:
        prompt = PROMPTS[0]
        first = pair.prefill.generate(prompt, 1, "late", {"do_remote_decode": True})
        time.sleep(1.6)  # the lease expires; the blocks stay cached (evictable) on prefill
        assert pair.prefill.stats().active_leases == 0
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        rest = pair.decode.generate(prompt + list(first.token_ids), MAX_TOKENS - 1, "late", params)
        assert list(first.token_ids) + list(rest.token_ids) == EXPECTED[0]
        full = len(prompt) // 16
        assert rest.stats.blocks_moved == full
        assert rest.stats.blocks_recomputed == (1 if len(prompt) % 16 else 0)
        assert check_no_leaks({"prefill": pair.prefill, "decode": pair.decode}) == []
    finally:
        pair.close()


def test_kv_for_another_prompt_is_never_used(tmp: Path) -> None:
    pair = Pair(tmp, "block-nhd", "block-nhd")
    try:
        first = pair.prefill.generate(PROMPTS[0], 1, "a", {"do_remote_decode": True})
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        wrong = list(PROMPTS[0])
        wrong[3] = (wrong[3] + 1) % 512
        rest = pair.decode.generate(wrong + list(first.token_ids), MAX_TOKENS - 1, "a", params)
        assert rest.stats.blocks_moved == 0
        expected = reference([wrong + list(first.token_ids)], MAX_TOKENS - 1)[0]
        assert list(rest.token_ids) == expected
        # prefill's lease is left to expire (decode never read it); decode leaks nothing
        assert check_no_leaks({"decode": pair.decode}) == []
    finally:
        pair.close()


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""Prefill/decode end to end: real nodes in separate processes, real NIXL, real gRPC.

Outputs are compared token for token with a single-process engine; pools and
leases are checked back to full/empty after every scenario.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvbridge.proto import codec
from kvbridge.worker.tools import check_no_leaks, make_workload
from tests.harness.nodes import NodePair, node_args, reference

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_TOKENS = 6
PROMPTS = make_workload(8, 2, 512, 16, seed=1)
EXPECTED = reference(PROMPTS, MAX_TOKENS)


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
    pair = NodePair(tmp, node_args(), prefill_order, decode_order)
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
    pair = NodePair(tmp, node_args())
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
    pair = NodePair(tmp, node_args(on_load_error="fail"))
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
    pair = NodePair(tmp, node_args(), prefill_extra=extra, decode_extra=extra)
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
    pair = NodePair(tmp, node_args())
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

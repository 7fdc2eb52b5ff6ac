"""A hybrid model (sliding-window + full attention) inside real vLLM (CPU), P/D through
KVBridgeConnector against one plain engine and against NixlConnector on the same prompts.

The model is a tiny Gemma-3-style decoder with seeded random weights
(:mod:`tests.harness.tiny_models`: one sliding-window layer, window 32 tokens, one
full-attention layer). vLLM's hybrid KV cache manager makes one KV cache group per
attention kind, the two groups sharing one KV cache tensor (a block id belongs to one
group at a time). KVBridgeConnector declares ``SupportsHMA``, so vLLM keeps those groups on
the prefill and the decode; kvbridge moves the full-attention group's prompt blocks and
only the sliding group's blocks still inside the window, as NixlConnector does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import (
    model_or_skip,
    nixl_pair,
    pd_one_at_a_time,
    pd_trio,
    write_tiny_model,
)

# five engines of a second model (~3 min): out of the default CI run, like the other long runs
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended, pytest.mark.timeout(900)]

PROMPTS = [[5, *range(10, 100), 7 + i] for i in range(2)]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [[9, *PROMPTS[0][1:]]]  # PROMPTS[0] with another first token
MAX_TOKENS = 8
HYBRID = ["FullAttentionSpec", "SlidingWindowSpec"]
PAGE = 32 * 2 * 64 * 2 * 4  # one layer's page of one block: 32 tokens x 2 heads x 64, K+V, fp32
MAX_RATIO = 1.1
"""kvbridge's bytes moved per request may be at most this times NixlConnector's."""


def _pd_one_at_a_time(
    engines: dict[str, harness.Engine], prompts: list[list[int]]
) -> list[list[int]]:
    """P/D of ``prompts`` one request at a time (one load per request in the stats)."""
    return pd_one_at_a_time(engines["prefill"], engines["decode"], prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, harness.Engine]]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    model_or_skip(tmp)  # the venv
    model = write_tiny_model("gemma3", tmp / "gemma3")
    port = 19000 + (hash(str(tmp)) % 1000)
    common = {"max_model_len": 512, "wait": False, "startup_timeout_s": 600.0}
    started = pd_trio(model, tmp, port, **common)
    with harness.running(started) as engines:
        yield engines


@pytest.fixture(scope="module")
def nixl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """NixlConnector P/D of the same model and prompts: its tokens, bytes per request and
    KV cache groups (its engines are stopped before the kvbridge ones are asked)."""
    tmp = tmp_path_factory.mktemp("vllm-hybrid-nixl")
    model_or_skip(tmp)
    model = write_tiny_model("gemma3", tmp / "gemma3")
    port = 21000 + (hash(str(tmp)) % 1000)
    common = {"max_model_len": 512, "wait": False, "startup_timeout_s": 600.0}
    with harness.running(nixl_pair(model, tmp, port, **common)) as engines:
        tokens = _pd_one_at_a_time(engines, PROMPTS)
        stats = engines["decode"].call(cmd="stats")
        groups = {n: sorted(e.call(cmd="stats")["kv_cache_groups"]) for n, e in engines.items()}
    return {
        "tokens": tokens,
        "bytes": stats["nixl_bytes"],
        "failed": stats["nixl_failed"],
        "groups": groups,
    }


def test_plain_vllm_keeps_its_hybrid_kv_cache_groups(engines: dict[str, harness.Engine]) -> None:
    assert sorted(engines["plain"].call(cmd="stats")["kv_cache_groups"]) == HYBRID


def test_kvbridge_engines_keep_vllms_hybrid_kv_cache_groups(
    engines: dict[str, harness.Engine],
) -> None:
    """``SupportsHMA``: vLLM keeps one KV cache group per attention kind on the prefill and
    the decode (without it, vLLM promotes the sliding layer to full attention: one group)."""
    for name in ("prefill", "decode"):
        assert sorted(engines[name].call(cmd="stats")["kv_cache_groups"]) == HYBRID, name


def test_greedy_output_depends_on_an_early_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate(OTHER_FIRST, MAX_TOKENS)
    )


def test_pd_of_the_hybrid_model_equals_one_plain_engine_moving_in_window_blocks_only(
    engines: dict[str, harness.Engine],
) -> None:
    prompts = [OTHER_FIRST[0], *PROMPTS]
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    assert _pd_one_at_a_time(engines, prompts) == expected
    stats = engines["decode"].call(cmd="stats")
    loads = list(stats["loads"].values())
    assert len(loads) == 3 and all(not x["error"] and x["verified"] for x in loads), loads
    # each group is its own layer's page of a block
    assert stats["layout"]["block_bytes"] == PAGE
    # the first prompt: the full group's 3 blocks (2 full + the partial last) and the
    # sliding group's 2 blocks holding tokens 60..91, moved, not recomputed
    assert loads[0]["moved"] == 5 and loads[0]["bytes"] == 5 * PAGE, loads
    # the others share their first token with no earlier prompt but PROMPTS[1] shares 91
    # tokens with PROMPTS[0]: decode's own prefix cache holds 2 blocks of each group, the
    # full group's last block and the sliding group's last block move
    assert loads[1]["moved"] == 5 and loads[1]["bytes"] == 5 * PAGE, loads
    assert loads[2]["moved"] == 2 and loads[2]["bytes"] == 2 * PAGE, loads


def test_kvbridge_moves_at_most_what_nixl_connector_moves_on_the_same_prompts(
    engines: dict[str, harness.Engine], nixl: dict[str, object]
) -> None:
    """The reference point: NixlConnector (``SupportsHMA``) on the same model and prompts,
    one request at a time, keeps the hybrid groups on both engines and equals the plain
    engine; kvbridge moves no more than ``MAX_RATIO`` times its bytes per request."""
    assert nixl["groups"] == {"prefill": HYBRID, "decode": HYBRID}
    assert not nixl["failed"], nixl
    expected = harness.tokens(engines["plain"].generate(PROMPTS, MAX_TOKENS))
    assert nixl["tokens"] == expected
    # kvbridge's decode already holds these prompts' blocks from the test above: a fresh
    # pair of prompts with the same shape (92 tokens, the second sharing 91 with the first)
    fresh = [[6, *range(110, 200), 7 + i] for i in range(2)]
    assert _pd_one_at_a_time(engines, fresh) == harness.tokens(
        engines["plain"].generate(fresh, MAX_TOKENS)
    )
    loads = list(engines["decode"].call(cmd="stats")["loads"].values())[-2:]
    ours = [x["bytes"] for x in loads]
    theirs = nixl["bytes"]
    assert isinstance(theirs, list) and len(theirs) == 2, nixl
    assert theirs[0] == 5 * PAGE, nixl  # full group: 3 blocks; sliding: cdiv(32, 32) + 1
    for a, b in zip(ours, theirs, strict=True):
        assert a <= MAX_RATIO * b, (ours, theirs)

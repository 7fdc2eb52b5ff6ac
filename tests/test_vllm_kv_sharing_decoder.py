"""A plain decoder with KV-sharing layers inside real vLLM (CPU): P/D through
KVBridgeConnector against one plain engine and against NixlConnector on the same prompts.

The model is :mod:`tests.harness.tiny_models` ``gemma4-full``: four full-attention layers,
the last two sharing the first two's KV, so vLLM makes one KV cache group whose layers
are the two that own KV. vLLM hands ``register_kv_caches`` the target layer's tensor under
a sharing layer's name; kvbridge counts each tensor once, so a block is the pages of the
two owning layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import (
    model_or_skip,
    nixl_pair,
    pd_one_at_a_time,
    pd_trio,
    write_tiny_model,
)

# five engines of a second model: out of the default CI run, like the other long runs
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended, pytest.mark.timeout(1500)]

PROMPTS = [[5, *range(10, 100), 7 + i] for i in range(2)]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [9, *PROMPTS[0][1:]]  # PROMPTS[0] with another first token
PD = [OTHER_FIRST, *PROMPTS]
"""One request at a time; PROMPTS[1] shares 91 tokens with PROMPTS[0]: decode's prefix cache
then holds its first 2 blocks and only the partial last one moves."""
BLOCKS = [3, 3, 1]
MAX_TOKENS = 8
BLOCK = 2 * 32 * 1 * 64 * 2 * 4
"""A block: the pages of the 2 layers that own KV (32 tokens x 1 KV head of 64, K and V,
fp32): 32 KiB; the sharing layers add nothing."""
MAX_RATIO = 1.1
COMMON: dict[str, Any] = {"max_model_len": 512, "wait": False, "startup_timeout_s": 900.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model directory for every engine: its path is the connector's ``model_id``."""
    tmp = tmp_path_factory.mktemp("gemma4-full")
    model_or_skip(tmp)  # the venv
    return write_tiny_model("gemma4-full", tmp / "gemma4-full")


def _pd_one_at_a_time(
    engines: dict[str, harness.Engine], prompts: list[list[int]]
) -> list[list[int]]:
    return pd_one_at_a_time(engines["prefill"], engines["decode"], prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def nixl(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """NixlConnector P/D of ``PD`` on fresh engines: tokens, bytes per request, KV cache
    groups (its engines are stopped when this returns)."""
    tmp = tmp_path_factory.mktemp("vllm-kv-sharing-decoder-nixl")
    port = 22000 + (hash(str(tmp)) % 1000) * 2
    with harness.running(nixl_pair(model, tmp, port, **COMMON)) as ready:
        tokens = _pd_one_at_a_time(ready, PD)
        stats = ready["decode"].call(cmd="stats")
        groups = {n: x.call(cmd="stats")["kv_cache_groups"] for n, x in ready.items()}
    return {
        "tokens": tokens,
        "bytes": stats["nixl_bytes"],
        "failed": stats["nixl_failed"],
        "groups": groups,
    }


@pytest.fixture(scope="module")
def engines(
    model: Path, nixl: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, harness.Engine]]:
    """The kvbridge prefill, decode and plain engine (after NixlConnector's are stopped:
    five engines at once do not fit the 2-core machine's patience)."""
    tmp = tmp_path_factory.mktemp("vllm-kv-sharing-decoder")
    port = 19500 + (hash(str(tmp)) % 400)
    with harness.running(pd_trio(model, tmp, port, **COMMON)) as ready:
        yield ready


def test_greedy_output_depends_on_an_early_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate([OTHER_FIRST], MAX_TOKENS)
    )


def test_pd_equals_one_plain_engine_moving_each_physical_block_once(
    engines: dict[str, harness.Engine],
) -> None:
    for name in ("plain", "prefill", "decode"):
        assert engines[name].call(cmd="stats")["kv_cache_groups"] == ["FullAttentionSpec"]
    expected = harness.tokens(engines["plain"].generate(PD, MAX_TOKENS))
    assert _pd_one_at_a_time(engines, PD) == expected
    stats = engines["decode"].call(cmd="stats")
    assert stats["layout"]["block_bytes"] == BLOCK
    loads = list(stats["loads"].values())
    assert len(loads) == len(PD), loads
    for blocks, load in zip(BLOCKS, loads, strict=True):
        assert not load["error"] and load["verified"], load
        assert load["moved"] == blocks and load["bytes"] == blocks * BLOCK, loads


def test_kvbridge_moves_at_most_what_nixl_connector_moves(
    engines: dict[str, harness.Engine], nixl: dict[str, Any]
) -> None:
    assert nixl["groups"] == {"prefill": ["FullAttentionSpec"], "decode": ["FullAttentionSpec"]}
    assert not nixl["failed"], nixl
    assert nixl["tokens"] == harness.tokens(engines["plain"].generate(PD, MAX_TOKENS))
    loads = list(engines["decode"].call(cmd="stats")["loads"].values())[: len(PD)]
    ours = [x["bytes"] for x in loads]
    theirs = nixl["bytes"]
    print(f"bytes per request: kvbridge {ours}, NixlConnector {theirs}")
    assert len(theirs) == len(PD), nixl
    for a, b in zip(ours, theirs, strict=True):
        assert 0 < a <= MAX_RATIO * b, (ours, theirs)

"""The CPU offload daemon with a KV-sharing model inside real vLLM (CPU).

The tiny Gemma-4-style model (:mod:`tests.harness.tiny_models` ``gemma4``: 4 layers,
the last two reading the KV of the first two). vLLM hands the connector the target layer's
tensor under a sharing layer's name; kvbridge counts each tensor once, so a block is the
pages of the 2 layers that own KV and the daemon's blocks are that size: the sharing layers
own no memory and are never stored or loaded. The same with ``gemma4-full`` (full
attention in every layer: a plain decoder whose last two layers share the first two's KV).
A *writer* computes the prompts and stores their full blocks (those its generated tokens
completed included); a fresh *reader* loads them from the daemon and must produce the
writer's tokens. The same at TP=2 with ``gemma4-kv2`` (2 KV heads, one per rank): every
rank stores and loads its own. The engines run with vLLM's hybrid KV cache manager off
(``--disable-hybrid-kv-cache-manager``): one KV cache group whose block is both owning
layers' pages (with the hybrid groups kept: ``test_vllm_offload_hybrid.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from kvbridge.worker.serving import OffloadDaemonProcess
from tests.harness.vllm import daemon_stats, offload_pair, published_growth

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.extended,
    pytest.mark.timeout(1200),
]

PROMPTS = [[5, *range(10, 100), 7 + i] for i in range(2)]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [9, *PROMPTS[0][1:]]
MAX_TOKENS = 8  # 99 tokens with KV: the generated tokens complete a third block
PAGE = 32 * 1 * 64 * 2 * 4  # one layer's page of a block: 1 KV head of 64, K and V, fp32
ONE_GROUP = {"disable_hybrid_kv_cache_manager": True}
"""vLLM's hybrid KV cache manager off: one KV cache group, a block is both owning layers'
pages (the hybrid groups kept: test_vllm_offload_hybrid.py)."""


@pytest.fixture(scope="module", params=["gemma4", "gemma4-full"])
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """``gemma4`` (hybrid, its groups merged into one here) or ``gemma4-full`` (the
    KV-sharing decoder: full attention only, one KV cache group either way)."""
    tmp = tmp_path_factory.mktemp("vllm-offload-kv-sharing")
    yield from offload_pair(tmp, request.param, 25000 + (hash(str(tmp)) % 1000) * 2, **ONE_GROUP)


@pytest.fixture(scope="module")
def engines_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-offload-kv-sharing-tp2")
    yield from offload_pair(tmp, "gemma4-kv2", 27000 + (hash(str(tmp)) % 1000) * 4, 2, **ONE_GROUP)


def test_kv_sharing_blocks_go_through_the_daemon_without_the_sharing_layers(
    engines: dict[str, Any],
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    daemon: OffloadDaemonProcess = engines["daemon"]
    expected = harness.tokens(writer.generate(PROMPTS, MAX_TOKENS))
    assert expected[0] != harness.tokens(writer.generate([OTHER_FIRST], MAX_TOKENS))[0]
    held = writer.call(cmd="drain", timeout_s=30)
    assert held["blocks_in_use"] == 0 and held["requests"] == 0, held
    stored = daemon_stats(daemon.address)
    # the daemon's block: the 2 layers that own KV, not 4
    assert stored["block_bytes"] == 2 * PAGE, stored
    # 2 shared prompt blocks, each prompt's third (completed by its generated tokens), and
    # OTHER_FIRST's 3
    assert stored["stored_blocks"] == 2 + len(PROMPTS) + 3, stored

    before = set(reader.call(cmd="stats")["loads"])
    got = harness.tokens(reader.generate(PROMPTS[:1], MAX_TOKENS))
    got += harness.tokens(reader.generate(PROMPTS[1:], MAX_TOKENS))
    assert got == expected
    stats = reader.call(cmd="drain", timeout_s=30)
    assert stats["layout"]["block_bytes"] == 2 * PAGE
    loads = [v for k, v in stats["loads"].items() if k not in before]
    # the first prompt's 2 full blocks; the second finds them in the reader's own cache
    assert [(x["offloaded"], x["moved"], x["error"]) for x in loads] == [(2, 0, "")], loads
    loaded = daemon_stats(daemon.address)
    assert loaded["loaded_blocks"] - stored["loaded_blocks"] == 2
    assert loaded["loaded_bytes"] - stored["loaded_bytes"] == 2 * 2 * PAGE
    assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, stats


def test_kv_sharing_at_tp2_every_rank_loads_its_own_blocks_from_the_daemon(
    engines_tp2: dict[str, Any],
) -> None:
    writer, reader = engines_tp2["writer"], engines_tp2["reader"]
    daemon: OffloadDaemonProcess = engines_tp2["daemon"]
    expected = harness.tokens(writer.generate(PROMPTS, MAX_TOKENS))
    assert expected[0] != harness.tokens(writer.generate([OTHER_FIRST], MAX_TOKENS))[0]
    held = writer.call(cmd="drain", timeout_s=30)
    assert held["tp"] == 2 and held["blocks_in_use"] == 0 and held["requests"] == 0, held
    stored = daemon_stats(daemon.address)
    # a rank's block: its 1 of the 2 KV heads in the 2 KV-owning layers
    assert stored["block_bytes"] == 2 * PAGE, stored
    assert stored["stored_blocks"] == 2 * (2 + len(PROMPTS) + 3), stored  # per rank

    before = reader.call(cmd="metrics")["text"]
    got = harness.tokens(reader.generate(PROMPTS[:1], MAX_TOKENS))
    got += harness.tokens(reader.generate(PROMPTS[1:], MAX_TOKENS))
    assert got == expected
    grew = published_growth(reader, before, "vllm:kvbridge_num_offloaded_blocks_total", 2 * 2)
    # the first prompt's 2 full blocks on each rank (a rank loads at most the 2 planned)
    assert grew("vllm:kvbridge_num_offloaded_blocks_total") == 2 * 2
    assert grew("vllm:kvbridge_xfer_time_seconds_count") == 2
    assert grew("vllm:kvbridge_num_failed_blocks_total") == 0
    loaded = daemon_stats(daemon.address)
    assert loaded["loaded_blocks"] - stored["loaded_blocks"] == 2 * 2
    assert loaded["loaded_bytes"] - stored["loaded_bytes"] == 2 * 2 * 2 * PAGE
    held = reader.call(cmd="drain", timeout_s=30)
    assert held["blocks_in_use"] == 0 and held["requests"] == 0, held

"""The CPU offload daemon with vLLM's hybrid KV cache groups kept, inside real vLLM (CPU).

The tiny Gemma-4-style model (:mod:`tests.harness.tiny_models` ``gemma4``: sliding, full,
sliding, full attention, window 32 tokens, block 32; the last two layers share the first
two's KV). vLLM keeps its two KV cache groups (``SupportsHMA``): kvbridge's ``self`` is the
full-attention group, ``g0`` the sliding one; the groups share their pages, so the
daemon's block is one layer's page and holds either group's block, each under its own
name. A *writer* computes a prompt and stores the full-attention group's full blocks and
the sliding group's blocks still in its window at the end (vLLM freed the others); a fresh
*reader* then:

- asks for a prompt that shares the first two full blocks: the daemon holds them, but not
  the sliding group's window before them, so nothing loads (computed);
- asks for the conversation's next turn (prompt, answer, new tokens): it loads the full
  block its own cache lacks and the sliding group's block of the window at that prefix
  from the daemon, and its tokens equal the writer's;
- decodes a prompt the writer prefilled (P/D): it takes the blocks the daemon holds of
  each group (a sliding group's where they are its window) from the daemon and only the
  rest from the prefill, and its tokens equal the writer's.

The same at TP=2 with ``gemma4-kv2`` (2 KV heads, one per rank): every rank stores and
loads its own.
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

PROMPT = [5, *range(10, 100), 7]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [9, *PROMPT[1:]]
MAX_TOKENS = 8  # 99 tokens with KV: the generated tokens complete a third block
SHARES_TWO = [*PROMPT[:64], *[3] * 30]  # 94 tokens: the first 2 full blocks are PROMPT's
PD_PROMPT = [6, *range(400, 502), 8]  # 104 tokens: 3 full blocks + 8, shared with no other
PAGE = 32 * 1 * 64 * 2 * 4  # one layer's page of a block: 1 KV head of 64, K and V, fp32
HYBRID = ["FullAttentionSpec", "SlidingWindowSpec"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-offload-hybrid")
    yield from offload_pair(tmp, "gemma4", 29000 + (hash(str(tmp)) % 1000) * 2)


@pytest.fixture(scope="module")
def engines_tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-offload-hybrid-tp2")
    yield from offload_pair(tmp, "gemma4-kv2", 31000 + (hash(str(tmp)) % 1000) * 4, tp=2)


def _write(writer: Any, daemon: OffloadDaemonProcess) -> tuple[list[int], list[int]]:
    """The writer's answer to PROMPT (stored) and the next turn's prompt; checks that the
    output depends on an early token and that vLLM kept its hybrid groups."""
    (answer,) = harness.tokens(writer.generate([PROMPT], MAX_TOKENS))
    assert answer != harness.tokens(writer.generate([OTHER_FIRST], MAX_TOKENS))[0]
    held = writer.call(cmd="drain", timeout_s=30)
    assert held["blocks_in_use"] == 0 and held["requests"] == 0, held
    assert sorted(held["kv_cache_groups"]) == HYBRID
    return answer, [*PROMPT, *answer, *[60 + i for i in range(10)]]  # 110 tokens


def test_hybrid_groups_go_through_the_daemon_and_a_fresh_reader_loads_them(
    engines: dict[str, Any],
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    daemon: OffloadDaemonProcess = engines["daemon"]
    _, follow_up = _write(writer, daemon)
    stored = daemon_stats(daemon.address)
    assert stored["block_bytes"] == PAGE, stored  # one page: either group's block
    # per prompt: the full group's 3 full blocks and the sliding group's block 2 (the
    # window at 99 tokens is tokens 68..98; vLLM freed blocks 0 and 1, never stored)
    assert stored["stored_blocks"] == 2 * (3 + 1), stored

    before = set(reader.call(cmd="stats")["loads"])
    # the daemon holds SHARES_TWO's first 2 full blocks, but not the sliding group's block
    # 1 that the window at 64 tokens needs, nor block 0 for 32: no hit, computed
    got = harness.tokens(reader.generate([SHARES_TWO], MAX_TOKENS))
    stats = reader.call(cmd="stats")
    assert sorted(stats["kv_cache_groups"]) == HYBRID
    assert set(stats["loads"]) == before, stats["loads"]
    assert daemon_stats(daemon.address)["loaded_blocks"] == stored["loaded_blocks"]
    assert got == harness.tokens(writer.generate([SHARES_TWO], MAX_TOKENS))

    before = set(reader.call(cmd="stats")["loads"])
    loaded_before = daemon_stats(daemon.address)
    got = harness.tokens(reader.generate([follow_up], MAX_TOKENS))
    stats = reader.call(cmd="drain", timeout_s=30)
    loads = [v for k, v in stats["loads"].items() if k not in before]
    loaded = daemon_stats(daemon.address)
    n = loaded["loaded_blocks"] - loaded_before["loaded_blocks"]
    # the reader's own cache holds 2 blocks of each group (from SHARES_TWO): the full
    # group's block 2 and the sliding group's block 2 (the window at 96 tokens) come from
    # the daemon, nothing is recomputed
    assert n == 2, loaded
    assert [(x["offloaded"], x["moved"], x["error"]) for x in loads] == [(n, 0, "")], loads
    assert loaded["loaded_bytes"] - loaded_before["loaded_bytes"] == n * PAGE
    assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, stats
    expected = harness.tokens(writer.generate([follow_up], MAX_TOKENS))
    assert got == expected
    # a token of the full-attention block the reader loaded, before the last token's
    # window: it reaches the answer through the full-attention layers only
    changed = [*follow_up[:65], 3, *follow_up[66:]]
    assert expected != harness.tokens(writer.generate([changed], MAX_TOKENS))


def test_a_hybrid_decode_takes_each_groups_daemon_blocks_and_only_the_rest_from_prefill(
    engines: dict[str, Any],
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    daemon: OffloadDaemonProcess = engines["daemon"]
    # the writer computes it alone first (the reference), which stores the full group's 3
    # full blocks and the sliding group's block 2 (the window at 111 tokens)
    (expected,) = harness.tokens(writer.generate([PD_PROMPT], MAX_TOKENS))
    assert expected != harness.tokens(writer.generate([[9, *PD_PROMPT[1:]]], MAX_TOKENS))[0]
    held = writer.call(cmd="drain", timeout_s=30)
    assert held["blocks_in_use"] == 0 and held["requests"] == 0, held
    before = set(reader.call(cmd="stats")["loads"])
    loaded_before = daemon_stats(daemon.address)
    pre = writer.generate([PD_PROMPT], 1, [{"do_remote_decode": True}])
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    assert harness.tokens(reader.generate([PD_PROMPT], MAX_TOKENS, params)) == [expected]
    stats = reader.call(cmd="drain", timeout_s=30)
    assert sorted(stats["kv_cache_groups"]) == HYBRID
    loads = [v for k, v in stats["loads"].items() if k not in before]
    # the decode's window at 104 tokens is the sliding group's blocks 2 and 3: from the
    # daemon the full group's blocks 0..2 and the sliding group's 2; from the prefill each
    # group's partial block 3, verified; nothing recomputed
    assert [(x["offloaded"], x["moved"], x["error"]) for x in loads] == [(4, 2, "")], loads
    assert loads[0]["bytes"] == 2 * PAGE and loads[0]["verified"], loads
    loaded = daemon_stats(daemon.address)
    assert loaded["loaded_blocks"] - loaded_before["loaded_blocks"] == 4, loaded
    assert loaded["loaded_bytes"] - loaded_before["loaded_bytes"] == 4 * PAGE, loaded
    assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, stats
    held = writer.call(cmd="drain", timeout_s=30)  # the decode released the prefill's lease
    assert held["blocks_in_use"] == 0 and held["leases"] == 0, held


def test_hybrid_groups_at_tp2_every_rank_stores_and_loads_its_own(
    engines_tp2: dict[str, Any],
) -> None:
    writer, reader = engines_tp2["writer"], engines_tp2["reader"]
    daemon: OffloadDaemonProcess = engines_tp2["daemon"]
    _, follow_up = _write(writer, daemon)
    stored = daemon_stats(daemon.address)
    assert stored["block_bytes"] == PAGE, stored  # a rank's block: its 1 of the 2 KV heads
    assert stored["stored_blocks"] == 2 * 2 * (3 + 1), stored  # per rank

    before = reader.call(cmd="metrics")["text"]
    loaded_before = daemon_stats(daemon.address)
    got = harness.tokens(reader.generate([follow_up], MAX_TOKENS))
    assert sorted(reader.call(cmd="stats")["kv_cache_groups"]) == HYBRID
    grew = published_growth(reader, before, "vllm:kvbridge_num_offloaded_blocks_total", 2 * 4)
    # a fresh cache: the full group's 3 blocks and the sliding group's block 2, per rank
    assert grew("vllm:kvbridge_num_offloaded_blocks_total") == 2 * 4
    assert grew("vllm:kvbridge_num_failed_blocks_total") == 0
    loaded = daemon_stats(daemon.address)
    assert loaded["loaded_blocks"] - loaded_before["loaded_blocks"] == 2 * 4
    assert loaded["loaded_bytes"] - loaded_before["loaded_bytes"] == 2 * 4 * PAGE
    assert got == harness.tokens(writer.generate([follow_up], MAX_TOKENS))

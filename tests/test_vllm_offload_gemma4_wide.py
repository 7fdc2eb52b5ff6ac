"""The CPU offload daemon with KV cache groups of their own page shape, inside real vLLM (CPU).

``gemma4-wide`` (:mod:`tests.harness.tiny_models`): the full-attention group has 32-token
blocks of head size 128, the sliding group (window 32 tokens) 64-token blocks of head size
64, 32 KiB pages both, sharing vLLM's pages. The daemon keeps one block size: either
group's block goes into a slot as the same bytes, under the group's own names. A *writer*
computes a prompt and stores the full group's full blocks and the sliding group's full
blocks still in its window at the end; a fresh *reader* then asks for the conversation's
next turn and loads both groups' blocks up to the last 64-token boundary (vLLM's hybrid
prefix hits land on the LCM of the block sizes) from the daemon alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from kvbridge.worker.serving import OffloadDaemonProcess
from tests.harness.vllm import daemon_stats, offload_pair

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended, pytest.mark.timeout(1200)]

PROMPT = [5, *range(10, 130), 7]  # 122 tokens; with 8 generated, 130 have KV
OTHER_FIRST = [9, *PROMPT[1:]]
MAX_TOKENS = 8
PAGE = 32 * 1 * 128 * 2 * 4  # either group's page: 32 x 1 x 128 or 64 x 1 x 64, K+V, fp32
HYBRID = ["FullAttentionSpec", "SlidingWindowSpec"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-offload-gemma4-wide")
    yield from offload_pair(tmp, "gemma4-wide", 33000 + (hash(str(tmp)) % 1000) * 2)


def test_both_groups_go_through_the_daemon_in_their_own_shape_and_a_fresh_reader_loads_them(
    engines: dict[str, Any],
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    daemon: OffloadDaemonProcess = engines["daemon"]
    (answer,) = harness.tokens(writer.generate([PROMPT], MAX_TOKENS))
    assert answer != harness.tokens(writer.generate([OTHER_FIRST], MAX_TOKENS))[0]
    held = writer.call(cmd="drain", timeout_s=30)
    assert held["blocks_in_use"] == 0 and held["requests"] == 0, held
    assert sorted(held["kv_cache_groups"]) == HYBRID
    stored = daemon_stats(daemon.address)
    print(f"daemon after the writer: {stored}")
    assert stored["block_bytes"] == PAGE, stored
    # per prompt (130 tokens with KV): the full group's 4 full blocks and the sliding
    # group's 64-token block 1 (the window at 130 tokens is tokens 99..129; vLLM freed
    # block 0, never stored; block 2 is not full)
    assert stored["stored_blocks"] == 2 * (4 + 1), stored

    follow_up = [*PROMPT, *answer, *[60 + i for i in range(10)]]  # 140 tokens
    before = set(reader.call(cmd="stats")["loads"])
    loaded_before = daemon_stats(daemon.address)
    got = harness.tokens(reader.generate([follow_up], MAX_TOKENS))
    stats = reader.call(cmd="drain", timeout_s=30)
    assert sorted(stats["kv_cache_groups"]) == HYBRID
    loads = [v for k, v in stats["loads"].items() if k not in before]
    loaded = daemon_stats(daemon.address)
    n = loaded["loaded_blocks"] - loaded_before["loaded_blocks"]
    print(f"reader loads {loads}, daemon {loaded}")
    # a hit on the 128-token boundary: the full group's blocks 0..3 and the sliding group's
    # block 1 (the window at 128 tokens), from the daemon alone; nothing recomputed
    assert n == 5, loaded
    assert [(x["offloaded"], x["moved"], x["error"]) for x in loads] == [(n, 0, "")], loads
    assert loaded["loaded_bytes"] - loaded_before["loaded_bytes"] == n * PAGE
    assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, stats
    expected = harness.tokens(writer.generate([follow_up], MAX_TOKENS))
    assert got == expected

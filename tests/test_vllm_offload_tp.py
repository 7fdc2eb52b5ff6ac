"""The CPU offload daemon behind kvbridge's vLLM connector at TP=2: every rank its own blocks.

A ``kvbridge offload serve`` daemon and two vLLM engines at ``--tensor-parallel-size 2``
(one worker process per rank, each engine's processes pinned to one core), both
``kv_both`` with ``offload_address``. Each rank stores its own half of every block's KV
heads under its own rank in the daemon and loads only its own; the scheduler's lookup asks
the daemon for every rank and plans the prefix all ranks hold. The *writer* computes the
prompts (the daemon is empty: its outputs are the reference, computed without loading) and
stores them; the *reader* is a fresh instance that loads them on both ranks and must
produce the same tokens. The reader's loads are read from vLLM's Prometheus registry,
which sums the ranks' connector stats: one sample per rank and load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from kvbridge.worker.serving import OffloadDaemonProcess
from tests.harness.vllm import daemon_stats, model_or_skip, offload_pair, published_growth

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.extended,
    pytest.mark.timeout(1200),
]

TP = 2
PREFIX = [5, *range(10, 80)]  # 71 tokens: two full shared blocks
PROMPTS = [PREFIX + [100 + i] * (40 + i) for i in range(4)]  # 111..114 tokens: 3 full blocks
OTHER_FIRST = [9, *PROMPTS[0][1:]]  # PROMPTS[0] with another first token
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-offload-tp")
    port = 23000 + (hash(str(tmp)) % 1000) * 4  # rank r of an engine serves at port + r
    for pair in offload_pair(
        tmp,
        model_or_skip(tmp),
        port,
        TP,
        lease_ttl_s=30,
        load_timeout_s=15,
        max_model_len=None,
        log_stats=("reader",),
    ):
        yield {**pair, "tmp": tmp}


def test_tp2_reader_loads_every_ranks_blocks_from_the_daemon_and_equals_the_writer(
    tp: dict[str, Any],
) -> None:
    writer, reader = tp["writer"], tp["reader"]
    daemon: OffloadDaemonProcess = tp["daemon"]
    # the writer computes everything itself (an empty daemon: nothing to load) and stores
    expected = harness.tokens(writer.generate(PROMPTS, MAX_TOKENS))
    # the early-token check: wrong KV must show in the tokens
    assert expected[0] != harness.tokens(writer.generate([OTHER_FIRST], MAX_TOKENS))[0]
    held = writer.call(cmd="drain", timeout_s=30)  # every rank's store over, blocks freed
    assert held["tp"] == TP and held["blocks_in_use"] == 0 and held["requests"] == 0, held
    stored = daemon_stats(daemon.address)
    # 2 shared + 4 own + 3 (OTHER_FIRST) distinct full blocks, once per rank
    assert stored["stored_blocks"] == stored["cached_blocks"] == TP * 9, stored

    before = reader.call(cmd="metrics")["text"]
    # the first prompt alone, so that the others find its prefix in the reader's cache
    got = harness.tokens(reader.generate(PROMPTS[:1], MAX_TOKENS))
    got += harness.tokens(reader.generate(PROMPTS[1:], MAX_TOKENS))
    assert got == expected
    count = "vllm:kvbridge_xfer_time_seconds_count"
    grew = published_growth(reader, before, count, TP * len(PROMPTS))
    # 3 blocks for the first prompt, then 1 each. A rank loads at most the blocks the plan
    # names, so a sum of TP x the plan means every rank loaded all of them from the daemon
    per_rank = 3 + 1 + 1 + 1
    assert grew("vllm:kvbridge_xfer_time_seconds_count") == TP * len(PROMPTS)
    assert grew("vllm:kvbridge_num_offloaded_blocks_total") == TP * per_rank
    assert grew("vllm:kvbridge_num_blocks_sum") == 0  # nothing from a peer
    assert grew("vllm:kvbridge_num_failed_transfers_total") == 0
    assert grew("vllm:kvbridge_num_failed_blocks_total") == 0
    loaded = daemon_stats(daemon.address)
    assert loaded["loaded_blocks"] - stored["loaded_blocks"] == TP * per_rank
    # each rank's block is its half of the heads: 4 layers x 32 tokens x 1 KV head x K,V x 64
    rank_block = 4 * 32 * 1 * 2 * 64 * 4
    assert loaded["block_bytes"] == rank_block, loaded
    assert loaded["loaded_bytes"] - stored["loaded_bytes"] == TP * per_rank * rank_block
    loads = grew(count)
    figures = {
        "rank_loads": loads,
        "avg_load_ms": grew("vllm:kvbridge_xfer_time_seconds_sum") / loads * 1e3,
        "blocks_per_rank": per_rank,
        "bytes_per_rank_block": rank_block,
    }
    (Path(tp["tmp"]) / "figures.json").write_text(json.dumps(figures, indent=1))
    print("figures", json.dumps(figures))  # shown with pytest -rP
    held = reader.call(cmd="drain", timeout_s=30)
    assert held["blocks_in_use"] == 0 and held["requests"] == 0, held

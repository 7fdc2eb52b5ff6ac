"""kvbridge inside real vLLM (CPU) with tensor parallelism: prefill TP=2 -> decode TP=2.

Three engines start once for the module: a prefill and a decode at TP=2 (vLLM's
``mp`` executor, one worker process per rank, each engine's processes pinned to
one core) and a TP=1 ``kv_both`` engine that is the plain reference and the
other side of the heterogeneous pairs. Each prefill rank leases the request's
blocks under the one lease id its scheduler chose and serves control at
``control_port + rank``; each decode rank reads its own KV heads from the same
rank. With TP>1 the connector's worker halves live in the rank processes, so the
decode's loads are read from vLLM's own KV-connector stats (Prometheus), which
vLLM aggregates over the ranks: one sample per rank per load.

A prefill and a decode of different TP sizes (one dividing the other) load head
slices: a TP=2 decode rank reads its half of every page of the TP=1 prefill; the
TP=1 decode reads both prefill ranks' pages into the two halves of its own.

Behind ``extended``: NixlConnector, the reference, on a fresh trio of the same shapes and
the same pairs, one request at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import metric, model_or_skip, nixl_tp_runs

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PREFIX = [5, *range(10, 80)]  # 71 tokens: two full shared blocks
PROMPTS = [PREFIX + [100 + i] * (i + 3) for i in range(4)]  # 3 blocks each
OTHER_FIRST = [9, *PREFIX[1:], 100, 100, 100]  # PROMPTS[0] with another first token
TP1_TO_TP2 = [[7, *range(200, 260), 300 + i] for i in range(2)]
TP2_TO_TP1 = [[8, *range(400, 460), 500 + i] for i in range(2)]
LINK_PROMPT = [[6, *range(600, 660)]]
"""Handed over once per pair before any test: it makes the pair's links (no prefix in
common with the tests' prompts)."""
LINK_TRIES = 4
MAX_TOKENS = 4
TTL_S = 30
"""Prefill leases: long enough for a first load that pays the handshake on a loaded machine;
the heterogeneous tests see them released well before it."""


@pytest.fixture(scope="module")
def tp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path]]:
    tmp = tmp_path_factory.mktemp("vllm-tp")
    model = model_or_skip(tmp)
    port = 21000 + (hash(str(tmp)) % 2000) * 2  # rank r serves at port + r
    started = {
        "prefill": harness.Engine(
            model,
            core=0,
            kv=harness.kv_config("kvbridge", "kv_producer", control_port=port, lease_ttl_s=TTL_S),
            log=tmp / "prefill.log",
            wait=False,
            tp=2,
        ),
        "decode": harness.Engine(
            model,
            core=1,
            kv=harness.kv_config("kvbridge", "kv_consumer", load_timeout_s=20),
            log=tmp / "decode.log",
            wait=False,
            log_stats=True,
            tp=2,
        ),
        "tp1": harness.Engine(
            model,
            core=1,
            kv=harness.kv_config(
                "kvbridge",
                "kv_both",
                control_port=port + 100,
                lease_ttl_s=TTL_S,
                load_timeout_s=20,
            ),
            log=tmp / "tp1.log",
            wait=False,
        ),
    }
    with harness.running(started) as engines:
        # every pair's links are made here, before any test counts its loads: a test then
        # measures its own loads over warm links, whichever test runs first and however
        # long a first link takes on a loaded machine
        _link(engines["prefill"], engines["decode"], tmp / "decode.log", port, (0, 1))
        _link(engines["tp1"], engines["decode"], tmp / "decode.log", port + 100, (0, 0))
        _link(engines["prefill"], engines["tp1"], tmp / "tp1.log", port, (0, 1))
        for producer in ("prefill", "tp1"):  # leases of a warm-up that gave up: expired
            held = engines[producer].call(cmd="drain", timeout_s=TTL_S + 10)
            assert held["blocks_in_use"] == 0, (producer, held)
        yield {**engines, "port": port}, tmp


def _link(
    producer: harness.Engine, consumer: harness.Engine, log: Path, port: int, ranks: tuple[int, ...]
) -> None:
    """Hand :data:`LINK_PROMPT` over from ``producer`` to ``consumer`` until the consumer's
    log shows a link to each of the producer's ranks it reads (control ``port + rank``). A
    load that gave up waiting for its link recomputes, and the link is still made behind it
    for the next try."""
    want = [rf"connected to \S+ at 127\.0\.0\.1:{port + rank} " for rank in ranks]
    for _ in range(LINK_TRIES):
        consumer.generate(LINK_PROMPT, 1, _handed_over(producer, LINK_PROMPT))
        if all(re.search(w, log.read_text()) for w in want):
            return
    raise AssertionError(f"no link to {want} after {LINK_TRIES} tries: {log.read_text()[-3000:]}")


def _handed_over(prefill: harness.Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    pre = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    return params


def _record(tmp: Path, name: str, figures: dict[str, Any]) -> None:
    """Keep a test's measured figures next to the engines' logs (``figures.json``)."""
    path = tmp / "figures.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**known, name: figures}, indent=1))


def test_greedy_output_depends_on_an_early_token(tp: tuple[dict[str, Any], Path]) -> None:
    plain = tp[0]["tp1"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate([OTHER_FIRST], MAX_TOKENS)
    )


def test_pd_tp2_to_tp2_gives_the_plain_engines_tokens_every_rank_loading_its_heads(
    tp: tuple[dict[str, Any], Path],
) -> None:
    engines, tmp = tp
    expected = harness.tokens(engines["tp1"].generate(PROMPTS, MAX_TOKENS))
    decode = engines["decode"]
    before = decode.call(cmd="metrics")["text"]
    got: list[list[int]] = []
    # the first prompt alone, so that the others find its prefix in decode's cache
    for batch in (PROMPTS[:1], PROMPTS[1:]):
        params = _handed_over(engines["prefill"], batch)
        assert {p["tp_size"] for p in params} == {2}
        got += harness.tokens(decode.generate(batch, MAX_TOKENS, params))
    assert got == expected
    # each decode rank dialed its own prefill rank: rank-0 port + rank
    log = (tmp / "decode.log").read_text()
    port = engines["port"]
    for rank in (0, 1):
        assert re.search(rf"connected to \S+ at 127\.0\.0\.1:{port + rank} ", log), log[-3000:]
    after = decode.call(cmd="metrics")["text"]

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name, before=True)

    # vLLM publishes a step's connector stats with a later step: an engine gone idle right
    # after the last load may not have published them yet. A request without a load steps it.
    for _ in range(3):
        if grew("vllm:kvbridge_xfer_time_seconds_count") >= 2 * len(PROMPTS):
            break
        decode.generate([[1, 2, 3, 4]], 1)
        after = decode.call(cmd="metrics")["text"]

    # vLLM aggregates the ranks' stats: one sample per rank and load (4 loads, 2 ranks);
    # 3 blocks for the first prompt, then 1 each (the shared prefix is in decode's cache)
    assert grew("vllm:kvbridge_xfer_time_seconds_count") == 2 * len(PROMPTS)
    assert grew("vllm:kvbridge_num_blocks_sum") == 2 * (3 + 1 + 1 + 1)
    assert grew("vllm:kvbridge_num_failed_transfers_total") == 0
    assert grew("vllm:kvbridge_num_failed_blocks_total") == 0
    # each rank moved its own half of the heads: one block of one rank's slice is
    # 4 layers x 32 tokens x 1 KV head x 2 x 64 floats
    per_rank_block = 4 * 32 * 1 * 2 * 64 * 4
    assert grew("vllm:kvbridge_bytes_transferred_sum") == 2 * 6 * per_rank_block


def test_no_blocks_held_on_either_side_afterwards(tp: tuple[dict[str, Any], Path]) -> None:
    engines, _ = tp
    # vLLM frees a held request only when every prefill rank reported it done sending
    prefill = engines["prefill"].call(cmd="drain", timeout_s=TTL_S + 10)
    assert prefill["tp"] == 2
    assert prefill["blocks_in_use"] == 0 and prefill["requests"] == 0, prefill
    decode = engines["decode"].call(cmd="drain", timeout_s=10)
    assert decode["blocks_in_use"] == 0 and decode["requests"] == 0, decode


def test_prefill_tp1_to_decode_tp2_loads_head_slices(tp: tuple[dict[str, Any], Path]) -> None:
    engines, tmp = tp
    expected = harness.tokens(engines["tp1"].generate(TP1_TO_TP2, MAX_TOKENS))
    params = _handed_over(engines["tp1"], TP1_TO_TP2)
    assert {p["tp_size"] for p in params} == {1}
    assert all(p["digest_key"] is not None for p in params)  # verified: per-head digests
    decode = engines["decode"]
    before = decode.call(cmd="metrics")["text"]
    assert harness.tokens(decode.generate(TP1_TO_TP2, MAX_TOKENS, params)) == expected
    after = decode.call(cmd="metrics")["text"]

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name, before=True)

    # both decode ranks loaded each prompt's 2 blocks from the one prefill rank: its own
    # half of the heads, one slice of each of the 4 layers' pages
    assert grew("vllm:kvbridge_xfer_time_seconds_count") == 2 * len(TP1_TO_TP2)
    assert grew("vllm:kvbridge_num_blocks_sum") == 2 * len(TP1_TO_TP2) * 2
    assert grew("vllm:kvbridge_num_failed_transfers_total") == 0
    assert grew("vllm:kvbridge_num_failed_blocks_total") == 0
    half_block = 4 * 32 * 1 * 2 * 64 * 4
    assert grew("vllm:kvbridge_bytes_transferred_sum") == 2 * len(TP1_TO_TP2) * 2 * half_block
    count = grew("vllm:kvbridge_xfer_time_seconds_count")
    _record(
        tmp,
        "tp1_to_tp2",
        {
            "rank_loads": count,
            "avg_transfer_ms": grew("vllm:kvbridge_xfer_time_seconds_sum") / count * 1e3,
            "bytes_per_rank_load": 2 * half_block,
        },
    )
    log = (tmp / "decode.log").read_text()
    assert "head_slice" in log and "heterogeneous TP is not supported" not in log
    # the prefill released its lease once both readers did (well before the TTL)
    held = engines["tp1"].call(cmd="drain", timeout_s=TTL_S - 2)
    assert held["blocks_in_use"] == 0 and held["leases"] == 0, held


def test_prefill_tp2_to_decode_tp1_loads_from_both_ranks(
    tp: tuple[dict[str, Any], Path],
) -> None:
    engines, tmp = tp
    # the reference from the TP=2 engine, so that the TP=1 decode has never seen these
    expected = harness.tokens(engines["decode"].generate(TP2_TO_TP1, MAX_TOKENS))
    params = _handed_over(engines["prefill"], TP2_TO_TP1)
    assert all(p["digest_key"] is not None for p in params)  # verified: each rank's digests
    decode = engines["tp1"]
    before = set(decode.call(cmd="stats")["loads"])
    assert harness.tokens(decode.generate(TP2_TO_TP1, MAX_TOKENS, params)) == expected
    stats = decode.call(cmd="drain", timeout_s=10)
    loads = [v for k, v in stats["loads"].items() if k not in before]
    assert len(loads) == len(TP2_TO_TP1), stats["loads"]
    full_block = 4 * 32 * 2 * 2 * 64 * 4
    for load in loads:  # 2 blocks each, read from both prefill ranks into their two halves
        assert load["moved"] == 2 and not load["error"] and load["verified"], load
        assert load["bytes"] == 2 * full_block and load["path"] == "sealed", load
        assert load["descriptors"] == 2 * 2 * 4, load  # one per (rank, block, layer) page
    _record(tmp, "tp2_to_tp1", {"loads": loads})
    log = (tmp / "tp1.log").read_text()
    port = engines["port"]
    for rank in (0, 1):
        assert re.search(rf"connected to \S+ at 127\.0\.0\.1:{port + rank} \(head_slice", log)
    prefill = engines["prefill"].call(cmd="drain", timeout_s=TTL_S - 2)
    assert prefill["blocks_in_use"] == 0 and prefill["requests"] == 0, prefill


@pytest.fixture(scope="module")
def nixl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """NixlConnector on its own TP trio (:func:`~tests.harness.vllm.nixl_tp_runs`): P/D of
    ``PROMPTS`` at TP=2 -> TP=2 and the heterogeneous prompts, one request at a time."""
    tmp = tmp_path_factory.mktemp("vllm-tp-nixl")
    model = model_or_skip(tmp)
    port = 36000 + (hash(str(tmp)) % 400) * 8
    prompts = {"tp2": PROMPTS, "tp1_to_tp2": TP1_TO_TP2, "tp2_to_tp1": TP2_TO_TP1}
    return nixl_tp_runs(model, tmp, port, prompts, MAX_TOKENS, wait=False)


@pytest.mark.extended  # three more TP engines (~5 min): the reference, out of the default run
@pytest.mark.timeout(1800)
def test_nixl_connector_at_tp2_and_heterogeneous_tp_moves_what_kvbridge_does(
    nixl: dict[str, Any],
) -> None:
    """Equal output for every pair, and per request the bytes the tests above require of
    kvbridge (a rank's half of each block: 4 layers x 32 tokens x 1 KV head x 64, K and
    V, fp32), one request at a time, so that a prompt whose prefix the decode holds moves
    only the rest."""
    assert nixl["groups"] == {n: ["FullAttentionSpec"] for n in ("prefill", "decode", "tp1")}
    half_block = 4 * 32 * 1 * 2 * 64 * 4
    for pair, blocks in (("tp2", [3, 1, 1, 1]), ("tp1_to_tp2", [2, 1])):
        tokens, growth = nixl[pair]
        assert tokens == nixl[f"expected_{pair}"], pair
        assert all(g["loads"] == 2 and g["failed"] == 0 for g in growth), (pair, growth)
        assert [g["bytes"] for g in growth] == [2 * b * half_block for b in blocks], growth
    tokens, reads, failed = nixl["tp2_to_tp1"]
    assert tokens == nixl["expected_tp2_to_tp1"] and not failed, nixl["tp2_to_tp1"]
    # one transfer per prefill rank: its half of each moved block
    assert reads == [b * half_block for b in (2, 1) for _ in range(2)], reads

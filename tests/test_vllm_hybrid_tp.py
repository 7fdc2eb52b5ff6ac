"""Model kinds at TP=2 and heterogeneous TP inside real vLLM (CPU), P/D through
KVBridgeConnector against a TP=1 engine and against NixlConnector on the same prompts.

Four tiny models with 2 KV heads, so that TP=2 gives each rank one
(:mod:`tests.harness.tiny_models`), one module run each:

- ``gemma4-kv2``: Gemma-4-style, sliding, full, sliding, full attention (window 32
  tokens), the last two layers sharing the first two's KV;
- ``gemma3``: Gemma-3-style, one sliding-window layer (window 32) and one full-attention
  layer;
- ``gemma4-full-kv2``: a KV-sharing decoder, full attention only, the last two of four
  layers sharing the first two's KV (one KV cache group);
- ``gemma4-wide-kv2``: ``gemma4-kv2`` with a head size of 128 for full attention: the
  groups' pages differ in shape (the sliding group has 64-token blocks of head size 64),
  so a head of a block is 32 KiB in either group.

vLLM keeps its KV cache groups (full attention, sliding window) on every engine; each rank
of a decode reads its own head of the full group's prompt blocks and of the sliding group's
in-window blocks from the same prefill rank. A TP=1 ``kv_both`` engine is the plain
reference and the other side of the heterogeneous pairs (TP=1 -> TP=2 and TP=2 -> TP=1:
head slices). With TP > 1 the worker halves live in the rank processes, so the TP=2
decodes' loads are read from vLLM's own KV-connector metrics (one sample per rank and load).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import (
    handed_over,
    metric,
    model_or_skip,
    nixl_tp_runs,
    pd_by_request,
    tp_trio,
    write_tiny_model,
)

# six TP engines per model (~6 min each on 2 loaded cores): out of the default CI run
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended, pytest.mark.timeout(2400)]

PROMPTS = [[5, *range(10, 100), 7 + i] for i in range(2)]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [9, *PROMPTS[0][1:]]  # PROMPTS[0] with another first token
PD = [OTHER_FIRST, *PROMPTS]
"""One request at a time: OTHER_FIRST and PROMPTS[0] share no block; PROMPTS[1] shares 91
tokens with PROMPTS[0], so decode's prefix cache holds 2 blocks of each group then."""
TP1_TO_TP2 = [[7, *range(200, 290), 300 + i] for i in range(2)]
TP2_TO_TP1 = [[8, *range(400, 490), 500 + i] for i in range(2)]
MAX_TOKENS = 8
HYBRID = ["FullAttentionSpec", "SlidingWindowSpec"]
HEAD_PAGE = 32 * 1 * 64 * 2 * 4
"""One layer's page of one KV head of a block: 32 tokens x 64, K and V, fp32 (16 KiB)."""
MAX_RATIO = 1.1
"""kvbridge's bytes moved per request may be at most this times NixlConnector's."""
TTL_S = 30
COMMON: dict[str, Any] = {"max_model_len": 512, "wait": False, "startup_timeout_s": 900.0}


@dataclass(frozen=True)
class Kind:
    """A tiny model and what P/D of ``PD`` moves per rank."""

    name: str
    groups: list[str]
    """vLLM's KV cache groups (spec names, sorted), on every engine."""
    blocks: list[int]
    """Blocks each P/D request of ``PD`` moves per rank. Hybrid: the full group's 3 (2
    full + the partial last) and the sliding group's 2 holding tokens 61..91; for the
    third, the full group's last block and the sliding group's last block."""
    pages: int
    """KV-owning layers' pages in a block of a group (a sharing layer has no memory)."""
    head_page: int = HEAD_PAGE
    """One layer's page of one KV head of a block."""

    @property
    def head_block(self) -> int:
        """The bytes of one KV head of one block: what a TP=2 rank moves per block."""
        return self.pages * self.head_page


KINDS = [
    Kind("gemma4-kv2", HYBRID, [5, 5, 2], 1),
    Kind("gemma3", HYBRID, [5, 5, 2], 1),
    Kind("gemma4-full-kv2", ["FullAttentionSpec"], [3, 3, 1], 2),
    Kind("gemma4-wide-kv2", HYBRID, [5, 5, 2], 1, 2 * HEAD_PAGE),
]


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def kind(request: pytest.FixtureRequest) -> Kind:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def model(kind: Kind, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model directory for every engine: its path is the connector's ``model_id``."""
    tmp = tmp_path_factory.mktemp(kind.name)
    model_or_skip(tmp)  # the venv
    return write_tiny_model(kind.name, tmp / kind.name)


@pytest.fixture(scope="module")
def engines(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, Any], Path]]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid-tp")
    port = 23000 + (hash(str(tmp)) % 1000) * 2  # rank r serves at port + r
    with harness.running(tp_trio(model, tmp, "kvbridge", port, TTL_S, **COMMON)) as ready:
        yield {**ready, "port": port}, tmp


@pytest.fixture(scope="module")
def kvbridge_pd(engines: tuple[dict[str, Any], Path]) -> dict[str, Any]:
    """KVBridgeConnector P/D of ``PD`` at TP=2 -> TP=2 (made once, read by two tests)."""
    e, _ = engines
    expected = harness.tokens(e["tp1"].generate(PD, MAX_TOKENS))
    got, growth = pd_by_request(e["prefill"], e["decode"], "kvbridge", PD, MAX_TOKENS)
    return {"expected": expected, "tokens": got, "growth": growth}


@pytest.fixture(scope="module")
def nixl(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """NixlConnector on fresh engines of the same model and shapes
    (:func:`~tests.harness.vllm.nixl_tp_runs`); its engines are stopped when this returns."""
    tmp = tmp_path_factory.mktemp("vllm-hybrid-tp-nixl")
    port = 24000 + (hash(str(tmp)) % 500) * 8
    prompts = {"tp2": PD, "tp1_to_tp2": TP1_TO_TP2, "tp2_to_tp1": TP2_TO_TP1}
    return nixl_tp_runs(model, tmp, port, prompts, MAX_TOKENS, **COMMON)


def test_greedy_output_depends_on_an_early_token(engines: tuple[dict[str, Any], Path]) -> None:
    plain = engines[0]["tp1"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate([OTHER_FIRST], MAX_TOKENS)
    )


def test_every_engine_keeps_vllms_kv_cache_groups(
    kind: Kind, engines: tuple[dict[str, Any], Path]
) -> None:
    for name in ("prefill", "decode", "tp1"):
        assert sorted(engines[0][name].call(cmd="stats")["kv_cache_groups"]) == kind.groups


def test_pd_tp2_equals_the_tp1_engine_every_rank_moving_its_head_of_each_group(
    kind: Kind, engines: tuple[dict[str, Any], Path], kvbridge_pd: dict[str, Any]
) -> None:
    e, tmp = engines
    assert kvbridge_pd["tokens"] == kvbridge_pd["expected"]
    for blocks, g in zip(kind.blocks, kvbridge_pd["growth"], strict=True):
        # one sample per rank and load, each rank its own head of every moved block
        assert g["loads"] == 2 and g["failed"] == 0 and g["failed_blocks"] == 0, g
        assert g["blocks"] == 2 * blocks, g
        assert g["bytes"] == 2 * blocks * kind.head_block, g
    log = (tmp / "decode.log").read_text()
    for rank in (0, 1):  # each decode rank dialed its own prefill rank
        assert re.search(rf"connected to \S+ at 127\.0\.0\.1:{e['port'] + rank} ", log)


def test_kvbridge_moves_at_most_what_nixl_connector_moves_at_tp2(
    kind: Kind, kvbridge_pd: dict[str, Any], nixl: dict[str, Any]
) -> None:
    """NixlConnector (``SupportsHMA``) on the same model, prompts and TP keeps the same
    groups and equals the TP=1 engine; kvbridge moves at most ``MAX_RATIO`` times its bytes
    per request."""
    assert nixl["groups"] == {"prefill": kind.groups, "decode": kind.groups, "tp1": kind.groups}
    assert nixl["expected_tp2"] == kvbridge_pd["expected"]
    tokens, growth = nixl["tp2"]
    assert tokens == kvbridge_pd["expected"]
    ours = [g["bytes"] for g in kvbridge_pd["growth"]]
    theirs = [g["bytes"] for g in growth]
    print(f"{kind.name}: bytes per request at TP=2 (all ranks): kvbridge {ours}, Nixl {theirs}")
    assert all(g["loads"] >= 1 and g["failed"] == 0 for g in growth), growth
    for a, b in zip(ours, theirs, strict=True):
        assert 0 < a <= MAX_RATIO * b, (ours, theirs)


def test_nixl_connector_moves_the_same_bytes_at_heterogeneous_tp(
    kind: Kind, nixl: dict[str, Any]
) -> None:
    """NixlConnector (the reference) on the heterogeneous pairs of the tests below: equal
    output, and per request the bytes those tests require of kvbridge (ratio 1.00)."""
    tokens, growth = nixl["tp1_to_tp2"]
    assert tokens == nixl["expected_tp1_to_tp2"]
    want = [2 * b * kind.head_block for b in kind.blocks[1:]]
    assert [g["bytes"] for g in growth] == want, growth
    tokens, reads, failed = nixl["tp2_to_tp1"]
    assert tokens == nixl["expected_tp2_to_tp1"] and not failed, nixl["tp2_to_tp1"]
    # one transfer per prefill rank: its head of each moved block
    assert reads == [b * kind.head_block for b in kind.blocks[1:] for _ in range(2)], reads


def test_prefill_tp1_to_decode_tp2_loads_head_slices_of_every_group(
    kind: Kind, engines: tuple[dict[str, Any], Path]
) -> None:
    e, tmp = engines
    expected = harness.tokens(e["tp1"].generate(TP1_TO_TP2, MAX_TOKENS))
    got, growth = pd_by_request(e["tp1"], e["decode"], "kvbridge", TP1_TO_TP2, MAX_TOKENS)
    assert got == expected
    # both ranks read their half of the heads of each moved block's pages: as many blocks
    # as the last two requests of ``PD`` (the second prompt shares 91 tokens with the first)
    for blocks, g in zip(kind.blocks[1:], growth, strict=True):
        assert g["loads"] == 2 and g["failed"] == 0 and g["failed_blocks"] == 0, g
        assert g["blocks"] == 2 * blocks and g["bytes"] == 2 * blocks * kind.head_block, g
    log = (tmp / "decode.log").read_text()
    assert "head_slice" in log
    held = e["tp1"].call(cmd="drain", timeout_s=TTL_S - 2)  # both readers released
    assert held["blocks_in_use"] == 0 and held["leases"] == 0, held


def test_prefill_tp2_to_decode_tp1_loads_from_both_ranks(
    kind: Kind, engines: tuple[dict[str, Any], Path]
) -> None:
    e, tmp = engines
    # the reference from the TP=2 decode, so that the TP=1 engine has never seen these
    expected = harness.tokens(e["decode"].generate(TP2_TO_TP1, MAX_TOKENS))
    decode = e["tp1"]
    before = set(decode.call(cmd="stats")["loads"])
    got = []
    for prompt in TP2_TO_TP1:
        params = handed_over(e["prefill"], [prompt])
        got += harness.tokens(decode.generate([prompt], MAX_TOKENS, params))
    assert got == expected
    stats = decode.call(cmd="drain", timeout_s=10)
    loads = [v for k, v in stats["loads"].items() if k not in before]
    assert len(loads) == len(TP2_TO_TP1), stats["loads"]
    # each page read from both prefill ranks into its halves
    for blocks, load in zip(kind.blocks[1:], loads, strict=True):
        assert load["moved"] == blocks and not load["error"] and load["verified"], load
        assert load["bytes"] == blocks * 2 * kind.head_block and load["path"] == "sealed", load
        # one descriptor per (prefill rank, block, owning layer)
        assert load["descriptors"] == 2 * blocks * kind.pages, load
    log = (tmp / "tp1.log").read_text()
    for rank in (0, 1):
        assert re.search(rf"connected to \S+ at 127\.0\.0\.1:{e['port'] + rank} \(head_slice", log)


def test_a_failed_load_recomputes_the_request_and_the_engine_goes_on(
    engines: tuple[dict[str, Any], Path],
) -> None:
    """With several KV cache groups vLLM takes load failures per request only (a block id
    is not unique across groups; block-level failures stop its engine): params whose
    digest key is not the hand-over's make every block fail its check, and the request is
    recomputed with the TP=1 engine's tokens."""
    e, _ = engines
    prompt = [4, *range(600, 690), 700]
    expected = harness.tokens(e["tp1"].generate([prompt], MAX_TOKENS))
    params = handed_over(e["prefill"], [prompt])
    params[0]["digest_key"] ^= 1
    decode = e["decode"]
    before = decode.call(cmd="metrics")["text"]
    assert harness.tokens(decode.generate([prompt], MAX_TOKENS, params)) == expected
    decode.generate([[1, 2, 3, 4]], 1)  # a step's stats leave with a later step
    after = decode.call(cmd="metrics")["text"]
    name = "vllm:kvbridge_num_failed_transfers_total"
    assert metric(after, name) - metric(before, name, before=True) == 2  # both ranks
    assert harness.tokens(decode.generate([PROMPTS[0]], MAX_TOKENS)) == harness.tokens(
        e["tp1"].generate([PROMPTS[0]], MAX_TOKENS)
    )


def test_no_blocks_held_on_either_side_afterwards(engines: tuple[dict[str, Any], Path]) -> None:
    e, _ = engines
    for name in ("prefill", "decode", "tp1"):
        stats = e[name].call(cmd="drain", timeout_s=TTL_S + 10)
        assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, (name, stats)

"""The CPU offload daemon behind kvbridge's vLLM connector: real daemon, two real vLLM engines.

A ``kvbridge offload serve`` daemon (main environment) and two vLLM engines
(``.venv-vllm``) with ``offload_address`` set, each pinned to a core and both
``kv_both``: the *writer* computes prompts first (the daemon is empty, so it
loads nothing: its outputs are the reference) and stores their full blocks;
the *reader* is a fresh instance that must load those blocks from the daemon
and produce the same tokens. The full blocks a request's generated tokens
completed are stored too: a follow-up whose prompt extends the first prompt and
its answer loads them. Then a P/D hand-over where decode takes the daemon's
blocks and only the rest from prefill, and finally a daemon that dies under
both engines (a miss, never an error or a leak).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from kvbridge.worker.serving import OffloadDaemonProcess
from tests.harness.vllm import daemon_stats, model_or_skip, offload_pair

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
PREFIX = [5, *range(10, 80)]  # 71 tokens: two full shared blocks
PROMPTS = [PREFIX + [100 + i] * (40 + i) for i in range(4)]  # 111..114 tokens: 3 full blocks
# 104 tokens (3 full blocks + 8 tokens), no block in common with each other or the above
PD_PROMPTS = [[6, i, *range(400, 462), *[500 + i] * 40] for i in range(2)]
MAX_TOKENS = 8
# 51 tokens (1 full block); with 50 generated tokens, 100 have KV: 3 full blocks
GEN_PROMPT = [4, *range(900, 950)]
GEN_TOKENS = 50


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The daemon, the writer and the reader (:func:`offload_pair`) of the tiny Llama."""
    tmp = tmp_path_factory.mktemp("vllm-offload")
    port = 19000 + (hash(str(tmp)) % 2000)  # str hash: varies per run, that is the point
    yield from offload_pair(tmp, model_or_skip(tmp), port, load_timeout_s=5, max_model_len=None)


@pytest.fixture(scope="module")
def daemon(pair: dict[str, Any]) -> OffloadDaemonProcess:
    proc: OffloadDaemonProcess = pair["daemon"]
    return proc


@pytest.fixture(scope="module")
def engines(pair: dict[str, Any]) -> dict[str, harness.Engine]:
    return {name: pair[name] for name in ("writer", "reader")}


def _loads(engine: harness.Engine, before: set[str]) -> list[dict[str, Any]]:
    loads: dict[str, dict[str, Any]] = engine.call(cmd="stats")["loads"]
    return [v for k, v in loads.items() if k not in before]


def _assert_nothing_held(engines: dict[str, harness.Engine]) -> None:
    for name, engine in engines.items():
        stats = engine.call(cmd="drain", timeout_s=20)
        assert stats["blocks_in_use"] == 0, (name, stats)
        assert stats["held_requests"] == stats["leases"] == stats["pending_sends"] == 0, stats
        assert stats["requests"] == 0, (name, stats)


@pytest.fixture(scope="module")
def written(
    engines: dict[str, harness.Engine], daemon: OffloadDaemonProcess
) -> tuple[list[list[int]], dict[str, Any]]:
    """The writer computes PROMPTS and a changed first prompt (the daemon holds none of their
    blocks: nothing to load) and stores their full blocks: its outputs (the reference) and
    what the daemon's counters grew by. Made once, by whichever test asks first (the tests
    run in any order)."""
    writer = engines["writer"]
    # the early-token check of test_vllm_pd, here too: wrong KV must show in the tokens
    changed = [9, *PROMPTS[0][1:]]
    before = set(writer.call(cmd="stats")["loads"])
    counted = daemon_stats(daemon.address)
    outputs = harness.tokens(writer.generate([*PROMPTS, changed], MAX_TOKENS))
    assert _loads(writer, before) == []  # an empty daemon: nothing was loaded
    _assert_nothing_held({"writer": writer})  # every store finished and released its blocks
    after = daemon_stats(daemon.address)
    grown = {k: after[k] - counted[k] for k in ("cached_blocks", "stored_blocks")}
    return outputs, {**after, **grown}


def test_writer_computes_and_stores_the_full_prompt_blocks(
    written: tuple[list[list[int]], dict[str, Any]],
) -> None:
    outputs, stats = written
    assert outputs[0] != outputs[-1]
    # 2 shared prefix blocks + one third block per prompt (+ the changed prompt's 3 blocks),
    # counted as growth; pinned and writing blocks as they are after the stores
    assert stats["cached_blocks"] == stats["stored_blocks"] == 2 + len(PROMPTS) + 3, stats
    assert stats["pinned_blocks"] == stats["writing_blocks"] == 0, stats


def test_a_fresh_instance_loads_the_prompt_blocks_from_the_daemon(
    engines: dict[str, harness.Engine],
    daemon: OffloadDaemonProcess,
    written: tuple[list[list[int]], dict[str, Any]],
) -> None:
    reader = engines["reader"]
    reference = {tuple(p): t for p, t in zip(PROMPTS, written[0], strict=False)}
    hits = daemon_stats(daemon.address)["loaded_blocks"]
    before = set(reader.call(cmd="stats")["loads"])
    # the first prompt alone: the others then find the shared prefix in reader's own cache
    got = harness.tokens(reader.generate(PROMPTS[:1], MAX_TOKENS))
    got += harness.tokens(reader.generate(PROMPTS[1:], MAX_TOKENS))
    assert got == [reference[tuple(p)] for p in PROMPTS]
    loads = _loads(reader, before)
    assert all(not x["error"] and x["moved"] == 0 for x in loads), loads
    assert sorted(x["offloaded"] for x in loads) == [1, 1, 1, 3], loads
    assert daemon_stats(daemon.address)["loaded_blocks"] - hits == 6
    _assert_nothing_held(engines)


def test_decode_takes_the_daemons_blocks_and_only_the_rest_from_prefill(
    engines: dict[str, harness.Engine],
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    # the writer computes them alone first, which also stores their full blocks
    expected = harness.tokens(writer.generate(PD_PROMPTS, MAX_TOKENS))
    _assert_nothing_held({"writer": writer})
    before = set(reader.call(cmd="stats")["loads"])
    pre = writer.generate(PD_PROMPTS, 1, [{"do_remote_decode": True}] * len(PD_PROMPTS))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    got = harness.tokens(reader.generate(PD_PROMPTS, MAX_TOKENS, params))
    assert got == expected
    loads = _loads(reader, before)
    assert len(loads) == len(PD_PROMPTS) and all(not x["error"] for x in loads), loads
    # 3 full blocks from the daemon, the partial last block from prefill's memory
    assert [(x["offloaded"], x["moved"]) for x in loads] == [(3, 1)] * len(PD_PROMPTS), loads
    _assert_nothing_held(engines)


def test_blocks_completed_by_generated_tokens_are_stored_and_a_follow_up_loads_them(
    engines: dict[str, harness.Engine], daemon: OffloadDaemonProcess
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    stored = daemon_stats(daemon.address)["stored_blocks"]
    (output,) = harness.tokens(writer.generate([GEN_PROMPT], GEN_TOKENS))
    _assert_nothing_held({"writer": writer})
    # the prompt's 1 full block and the 2 more its generated tokens completed
    assert daemon_stats(daemon.address)["stored_blocks"] - stored == 3
    # a conversation's next turn: the first turn's prompt and answer, then new tokens
    follow_up = [*GEN_PROMPT, *output, *[60 + i for i in range(10)]]  # 111 tokens
    before = set(reader.call(cmd="stats")["loads"])
    got = harness.tokens(reader.generate([follow_up], MAX_TOKENS))
    loads = _loads(reader, before)
    assert [(x["offloaded"], x["moved"], x["error"]) for x in loads] == [(3, 0, "")], loads
    # the writer's own answer, from its own prefix cache; an early token changes it
    assert got == harness.tokens(writer.generate([follow_up], MAX_TOKENS))
    changed = [9, *follow_up[1:]]
    assert got != harness.tokens(writer.generate([changed], MAX_TOKENS))
    _assert_nothing_held(engines)


@pytest.mark.destructive
def test_a_dead_daemon_is_a_miss_and_nothing_leaks(
    engines: dict[str, harness.Engine], daemon: OffloadDaemonProcess
) -> None:
    writer, reader = engines["writer"], engines["reader"]
    daemon.kill()
    prompts = [[7, *range(600, 700), 800 + i] for i in range(2)]
    expected = harness.tokens(writer.generate(prompts, MAX_TOKENS))  # its stores fail: still freed
    before = set(reader.call(cmd="stats")["loads"])
    assert harness.tokens(reader.generate(prompts, MAX_TOKENS)) == expected
    assert _loads(reader, before) == []  # lookups miss: nothing to load
    _assert_nothing_held(engines)

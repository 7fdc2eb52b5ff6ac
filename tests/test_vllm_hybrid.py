"""A hybrid model (sliding-window + full attention) inside real vLLM (CPU), P/D through
KVBridgeConnector against one plain engine.

The model is a tiny Gemma-3-style decoder with seeded random weights
(:mod:`tests.harness.tiny_models`: one sliding-window layer, window 32 tokens, one
full-attention layer). A plain vLLM engine keeps its hybrid KV cache manager: one KV cache
group per attention kind. KVBridgeConnector does not declare vLLM's ``SupportsHMA`` yet, so
vLLM turns the hybrid manager off on its engines (one full-attention group, the sliding
layer keeps and moves its whole context): the output is still the plain engine's, which is
what these tests prove, and one test pins the single group until the connector declares
``SupportsHMA`` (docs/VLLM.md, "Model kinds").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import model_or_skip, pd_trio, write_tiny_model

# three engines of a second model (~1.5 min): out of the default CI run, like the other long runs
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended, pytest.mark.timeout(900)]

PROMPTS = [[5, *range(10, 100), 7 + i] for i in range(2)]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [[9, *PROMPTS[0][1:]]]  # PROMPTS[0] with another first token
MAX_TOKENS = 8
HYBRID = ["FullAttentionSpec", "SlidingWindowSpec"]


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


def test_plain_vllm_keeps_its_hybrid_kv_cache_groups(engines: dict[str, harness.Engine]) -> None:
    assert sorted(engines["plain"].call(cmd="stats")["kv_cache_groups"]) == HYBRID


def test_greedy_output_depends_on_an_early_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate(OTHER_FIRST, MAX_TOKENS)
    )


def test_pd_of_the_hybrid_model_equals_one_plain_engine(
    engines: dict[str, harness.Engine],
) -> None:
    prompts = PROMPTS + OTHER_FIRST
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    pre = engines["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    got = harness.tokens(engines["decode"].generate(prompts, MAX_TOKENS, params))
    assert got == expected
    loads = list(engines["decode"].call(cmd="stats")["loads"].values())
    assert loads and all(not x["error"] for x in loads), loads
    # the blocks came over the connector: the prompt's 3 blocks (2 full + the partial last)
    # of every prompt, nothing recomputed
    assert all(x["moved"] == 3 and x["path"] for x in loads), loads
    # hybrid manager off: a block holds both layers' pages (2 x 32 tokens x 2 heads x 64 x
    # K,V x fp32 = 64 KiB), the sliding layer's out-of-window blocks included
    block_bytes = engines["decode"].call(cmd="stats")["layout"]["block_bytes"]
    assert block_bytes == 2 * 32 * 2 * 64 * 2 * 4
    assert all(x["bytes"] == 3 * block_bytes for x in loads), loads


def test_kvbridge_engines_have_one_kv_cache_group_until_it_supports_hma(
    engines: dict[str, harness.Engine],
) -> None:
    """The known gap, pinned: vLLM turns its hybrid KV cache manager off for a connector
    without ``SupportsHMA`` (the sliding-window layer is promoted to full attention).
    Declaring ``SupportsHMA`` must turn this into "kept the plain engine's groups"."""
    for name in ("prefill", "decode"):
        assert engines[name].call(cmd="stats")["kv_cache_groups"] == ["FullAttentionSpec"], name


@pytest.mark.extended
def test_nixl_connector_keeps_the_groups_and_moves_in_window_blocks_only(
    tmp_path: Path,
) -> None:
    """The reference point: NixlConnector (``SupportsHMA``) on the same model and prompts
    keeps vLLM's hybrid groups on both engines, equals the plain engine, and moves the
    full-attention group's 3 blocks but only the sliding group's in-window blocks."""
    model_or_skip(tmp_path)
    model = write_tiny_model("gemma3", tmp_path / "gemma3")
    port = 21000 + (hash(str(tmp_path)) % 1000)
    common = {"max_model_len": 512, "wait": False, "startup_timeout_s": 600.0}
    started = {
        "prefill": harness.Engine(
            model,
            core=0,
            kv=harness.kv_config("nixl", "kv_producer"),
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
            log=tmp_path / "prefill.log",
            **common,
        ),
        "decode": harness.Engine(
            model,
            core=1,
            kv=harness.kv_config("nixl", "kv_consumer"),
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 1)},
            log=tmp_path / "decode.log",
            **common,
        ),
        "plain": harness.Engine(model, core=1, log=tmp_path / "plain.log", **common),
    }
    with harness.running(started) as engines:
        expected = harness.tokens(engines["plain"].generate(PROMPTS, MAX_TOKENS))
        got = []
        for prompt in PROMPTS:  # one at a time: one transfer per request in the stats
            pre = engines["prefill"].generate([prompt], 1, [{"do_remote_decode": True}])
            params = [o["kv_transfer_params"] for o in pre["outputs"]]
            got += harness.tokens(engines["decode"].generate([prompt], MAX_TOKENS, params))
        stats = engines["decode"].call(cmd="stats")
        for name in ("prefill", "decode"):
            assert sorted(engines[name].call(cmd="stats")["kv_cache_groups"]) == HYBRID
    assert got == expected
    assert not stats["nixl_failed"], stats
    page = 32 * 2 * 64 * 2 * 4  # one layer's page of one block, fp32
    # full group: 3 blocks; sliding group: cdiv(32, 32) + 1 = 2 in-window blocks
    # (measured: 160 KiB for the first prompt; kvbridge moves 3 x 64 KiB = 192 KiB; the
    # second prompt shares decode's cached prefix: 64 KiB)
    assert stats["nixl_bytes"][0] == 5 * page, stats
    assert all(b <= 5 * page for b in stats["nixl_bytes"]), stats

"""KV-sharing layers in a hybrid model inside real vLLM (CPU): each physical block moves
once, and vLLM keeps its hybrid KV cache groups.

A tiny Gemma-4-style model (:mod:`tests.harness.tiny_models` ``gemma4``: sliding,
full, sliding, full attention, window 32 tokens; the last two layers share the first two's
KV). vLLM's hybrid KV cache manager stays on with KVBridgeConnector (``SupportsHMA``): one
KV cache group per attention kind, each with one layer that owns KV and one that shares
it. vLLM hands ``register_kv_caches`` the target layer's tensor under a sharing layer's
name; kvbridge counts a tensor once, so a block of a group is one layer's page, not two.
P/D through KVBridgeConnector equals one plain engine token for token with the full
group's prompt blocks and the sliding group's in-window blocks moved, not recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import model_or_skip, pd_trio, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[5, *range(10, 100), 7 + i] for i in range(2)]  # 92 tokens: 2 full blocks + 28
OTHER_FIRST = [[9, *PROMPTS[0][1:]]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma-4-style model every engine of the module runs: one directory, because
    vLLM's model path is the connector's default ``model_id``, which roots the block names
    (an engine on a copy elsewhere names its blocks differently, and decode recomputes)."""
    tmp = tmp_path_factory.mktemp("gemma4")
    model_or_skip(tmp)  # the venv
    return write_tiny_model("gemma4", tmp / "gemma4")


@pytest.fixture(scope="module")
def engines(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, harness.Engine]]:
    tmp = tmp_path_factory.mktemp("vllm-kv-sharing")
    port = 20000 + (hash(str(tmp)) % 1000)
    common = {"max_model_len": 512, "wait": False, "startup_timeout_s": 600.0}
    started = pd_trio(model, tmp, port, **common)
    with harness.running(started) as engines:
        yield engines


def test_greedy_output_depends_on_an_early_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate(OTHER_FIRST, MAX_TOKENS)
    )


def test_pd_with_kv_sharing_layers_equals_one_plain_engine_moving_each_block_once(
    engines: dict[str, harness.Engine],
) -> None:
    prompts = PROMPTS + OTHER_FIRST
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    pre = engines["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    got = harness.tokens(engines["decode"].generate(prompts, MAX_TOKENS, params))
    assert got == expected
    stats = engines["decode"].call(cmd="stats")
    page = 32 * 1 * 64 * 2 * 4  # one layer's page of a block: 1 KV head of 64, K and V, fp32
    assert stats["layout"]["block_bytes"] == page  # per group: 1 layer owns KV, 1 shares it
    loads = list(stats["loads"].values())
    assert len(loads) == 3 and all(not x["error"] for x in loads), loads
    # the full group's 3 blocks (2 full + the partial last) and the sliding group's 2
    # blocks holding tokens 61..91 (vLLM has freed the first): 80 KiB, 96 KiB without HMA
    assert all(x["moved"] == 5 and x["bytes"] == 5 * page for x in loads), loads


def test_vllm_keeps_its_hybrid_groups_on_every_engine(
    engines: dict[str, harness.Engine],
) -> None:
    """``SupportsHMA``: the prefill and the decode keep the plain engine's KV cache groups
    (without it vLLM turns its hybrid KV cache manager off: one full-attention group)."""
    for name in ("plain", "prefill", "decode"):
        groups = sorted(engines[name].call(cmd="stats")["kv_cache_groups"])
        assert groups == ["FullAttentionSpec", "SlidingWindowSpec"], name


@pytest.mark.extended
def test_prefill_with_kv_sharing_fast_prefill_hands_over_the_same_kv(
    engines: dict[str, harness.Engine], model: Path, tmp_path: Path
) -> None:
    """vLLM's prefill skip (``kv_sharing_fast_prefill``) on a prefill: the sharing layers
    write no KV, so decode's tokens are the plain engine's (and the prefill's wall time,
    for docs/VLLM.md, is printed)."""
    prompts = [[3, *range(200, 290), 4 + i] for i in range(2)]  # not in any cache yet
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    port = 20500 + (hash(str(tmp_path)) % 400)
    kv = harness.kv_config("kvbridge", "kv_producer", control_port=port, lease_ttl_s=20)
    with harness.Engine(
        model,
        core=0,
        kv=kv,
        log=tmp_path / "fast-prefill.log",
        max_model_len=512,
        startup_timeout_s=600.0,
        llm_args={"kv_sharing_fast_prefill": True},
    ) as fast:
        pre = fast.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
        params = [o["kv_transfer_params"] for o in pre["outputs"]]
        got = harness.tokens(engines["decode"].generate(prompts, MAX_TOKENS, params))
        slow = engines["prefill"].generate(
            [[3, *range(300, 390), 4]], 1, [{"do_remote_decode": True}]
        )
        again = fast.generate([[3, *range(400, 490), 4]], 1, [{"do_remote_decode": True}])
    print(f"prefill wall ms: fast-prefill {again['wall_ms']:.1f}, plain {slow['wall_ms']:.1f}")
    assert got == expected
    loads = list(engines["decode"].call(cmd="stats")["loads"].values())
    assert all(not x["error"] for x in loads), loads
    assert loads and all(x["moved"] == 5 for x in loads), loads  # moved, not recomputed


@pytest.mark.extended
def test_prefill_skip_leaves_the_sharing_layers_out_and_hands_over_the_same_kv(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """vLLM's prefill skip on a model whose sharing layers cost most of a prefill
    (``gemma4-deep``: 6 of 8 layers share the first two's KV): two kvbridge prefills, with
    and without ``kv_sharing_fast_prefill``, hand the same prompts over to one decode, whose
    tokens equal a single engine's either way; the prefills' wall times (fresh prompts,
    interleaved) are printed for docs/VLLM.md."""
    tmp = tmp_path_factory.mktemp("vllm-prefill-skip")
    model_or_skip(tmp)
    model = write_tiny_model("gemma4-deep", tmp / "gemma4-deep")
    port = 20600 + (hash(str(tmp)) % 300) * 2
    common = {"max_model_len": 512, "wait": False, "startup_timeout_s": 900.0}
    started = {
        name: harness.Engine(
            model,
            core=0,
            kv=harness.kv_config("kvbridge", "kv_producer", control_port=port + i, lease_ttl_s=20),
            log=tmp / f"{name}.log",
            llm_args={"kv_sharing_fast_prefill": fast},
            **common,
        )
        for i, (name, fast) in enumerate((("skip", True), ("plain", False)))
    }
    started["decode"] = harness.Engine(
        model,
        core=1,
        kv=harness.kv_config("kvbridge", "kv_consumer", load_timeout_s=10),
        log=tmp / "decode.log",
        **common,
    )
    n = 256  # 8 blocks
    with harness.running(started) as e:
        first = [[3, *range(100, 100 + n - 1)], [9, *range(100, 100 + n - 1)]]
        assert harness.tokens(e["plain"].generate(first[:1], MAX_TOKENS)) != harness.tokens(
            e["plain"].generate(first[1:], MAX_TOKENS)
        )
        times: dict[str, list[float]] = {"skip": [], "plain": []}
        for i in range(4):
            for name in ("skip", "plain"):  # interleaved; each prompt new to every engine
                prompt = [4 + i, *range(200 + 7 * i, 200 + 7 * i + n - 1)]
                if name == "plain":
                    prompt[0] += 400
                pre = e[name].generate([prompt], 1, [{"do_remote_decode": True}])
                times[name].append(pre["wall_ms"])
                # after the timed prefill: the plain engine's cache then holds its own prompt
                expected = harness.tokens(e["plain"].generate([prompt], MAX_TOKENS))
                params = [o["kv_transfer_params"] for o in pre["outputs"]]
                got = harness.tokens(e["decode"].generate([prompt], MAX_TOKENS, params))
                assert got == expected, (name, i)
        loads = list(e["decode"].call(cmd="stats")["loads"].values())
    assert len(loads) == 8 and all(not x["error"] and x["moved"] for x in loads), loads
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"prefill wall ms of {n}-token prompts: {times}; medians {med}")

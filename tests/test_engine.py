"""Behaviour of the reference engine on its own: determinism, layouts, prefix caching."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvbridge.proto import ORDERS, PRESETS, BlockId, ConfigError
from kvbridge.worker.engine import Engine, EngineConfig
from tests.harness.engine import run_to_end

BLOCK = 16

pytestmark = pytest.mark.usefixtures("one_thread")


def make_prompts(count: int, length: int, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def assert_all_blocks_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert not engine.has_held_blocks()
    for name, pool in engine.pools.items():
        assert engine.num_free_blocks(name) == pool.num_blocks


PROMPTS = make_prompts(3, 37, seed=1) + make_prompts(1, 48, seed=2) + make_prompts(1, 5, seed=3)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    torch.set_num_threads(1)
    engine = Engine(EngineConfig())
    out = engine.generate(PROMPTS, 12)
    assert_all_blocks_free(engine)
    return out


def test_greedy_output_is_identical_across_engine_instances(
    reference: list[list[int]],
) -> None:
    engine = Engine(EngineConfig())
    assert engine.generate(PROMPTS, 12) == reference
    assert all(len(tokens) == 12 for tokens in reference)
    assert len({tuple(t) for t in reference}) == len(reference)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("order", list(ORDERS))
def test_every_physical_order_gives_identical_outputs(
    order: str, reference: list[list[int]]
) -> None:
    engine = Engine(EngineConfig(order=order))
    assert engine.layout.order == ORDERS[order]
    assert engine.generate(PROMPTS, 12) == reference
    assert_all_blocks_free(engine)


def test_changing_an_early_prompt_token_changes_the_output() -> None:
    engine = Engine(EngineConfig())
    prompt = make_prompts(1, 40, seed=4)[0]
    changed = list(prompt)
    changed[1] = (changed[1] + 1) % 512
    first, second = engine.generate([prompt, changed], 8)
    assert first != second
    assert_all_blocks_free(engine)


def test_a_request_computes_the_same_alone_and_alongside_others(
    reference: list[list[int]],
) -> None:
    engine = Engine(EngineConfig())
    assert engine.generate([PROMPTS[3]], 12) == [reference[3]]


def test_prefix_cache_hits_match_a_cold_cache_and_skip_compute() -> None:
    shared = make_prompts(1, 3 * BLOCK, seed=5)[0]
    first = shared + make_prompts(1, 7, seed=6)[0]
    second = shared + make_prompts(1, 9, seed=7)[0]
    cold = Engine(EngineConfig())
    cold_tokens = cold.generate([second], 10)
    cold_computed = cold.num_tokens_computed

    warm = Engine(EngineConfig())
    warm.generate([first], 10)
    before = warm.num_tokens_computed
    warm.add_request(second, 10, request_id="second")
    out = run_to_end(warm)["second"]
    assert list(out.output_token_ids) == cold_tokens[0]
    assert out.blocks_local_hit == 3
    assert out.num_computed_tokens == cold_computed - 3 * BLOCK
    assert warm.num_tokens_computed - before == cold_computed - 3 * BLOCK
    assert out.ttft_s is not None and out.ttft_s > 0
    assert_all_blocks_free(warm)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    prompt = make_prompts(1, 2 * BLOCK, seed=8)[0]
    engine = Engine(EngineConfig())
    (expected,) = engine.generate([prompt], 4)
    engine.add_request(prompt, 4, request_id="again")
    out = run_to_end(engine)["again"]
    assert list(out.output_token_ids) == expected
    assert out.blocks_local_hit == 1  # the block holding the last prompt token is recomputed
    assert_all_blocks_free(engine)


def test_requests_wait_for_blocks_and_finish_with_the_same_output(
    reference: list[list[int]],
) -> None:
    engine = Engine(EngineConfig(num_blocks=4))  # one request (37 + 11 tokens) at a time
    assert engine.generate(PROMPTS[:3], 12) == reference[:3]
    assert_all_blocks_free(engine)


def test_a_request_larger_than_the_pool_is_rejected() -> None:
    engine = Engine(EngineConfig(num_blocks=2))
    with pytest.raises(ConfigError, match="num_blocks"):
        engine.add_request(list(range(40)), 4)


def test_bad_requests_are_rejected_with_the_reason() -> None:
    engine = Engine(EngineConfig())
    with pytest.raises(ConfigError, match="vocabulary"):
        engine.add_request([1, 512], 4)
    with pytest.raises(ConfigError, match="max_tokens"):
        engine.add_request([1, 2], 0)
    engine.add_request([1, 2], 2, request_id="x")
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request([1, 2], 2, request_id="x")
    run_to_end(engine)
    assert_all_blocks_free(engine)


def test_abort_frees_waiting_and_running_requests() -> None:
    engine = Engine(EngineConfig(num_blocks=4))
    running = engine.add_request(PROMPTS[0], 12)
    waiting = engine.add_request(PROMPTS[1], 12)
    engine.step()
    assert engine.num_free_blocks() == 1
    aborted = engine.abort(waiting)
    assert aborted is not None and aborted.finish_reason == "abort"
    out = engine.abort(running)
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort(running) is None
    assert_all_blocks_free(engine)


def test_pins_from_another_thread_under_the_lock_change_no_output(
    reference: list[list[int]],
) -> None:
    """The control server pins and unpins blocks under leases from its own thread."""
    engine = Engine(EngineConfig())
    stop = threading.Event()
    pins = 0

    def pin_and_unpin() -> None:
        nonlocal pins
        rng = random.Random(0)
        while not stop.is_set():
            block = BlockId(rng.randrange(engine.pools["self"].num_blocks))
            with engine.lock:
                engine.pools["self"].touch([block])
            time.sleep(0.0005)
            with engine.lock:
                engine.pools["self"].free([block])
            pins += 1

    thread = threading.Thread(target=pin_and_unpin)
    thread.start()
    try:
        assert engine.generate(PROMPTS, 12) == reference
    finally:
        stop.set()
        thread.join()
    assert pins > 0
    assert_all_blocks_free(engine)


def test_kv_sharing_layers_compute_queries_only_and_work_in_every_order() -> None:
    outputs = []
    for order in ("block-nhd", "layer-hnd"):
        engine = Engine(EngineConfig(share_last=1, order=order))
        sharing = [x for x in engine.layout.layers if x.kv_source is not None]
        assert [x.name for x in sharing] == ["layers.3.self_attn"]
        assert engine.kv_caches["layers.3.self_attn"] is engine.kv_caches["layers.2.self_attn"]
        assert engine.model.layers[3].wk is None
        outputs.append(engine.generate(PROMPTS[:2], 6))
        assert_all_blocks_free(engine)
    assert outputs[0] == outputs[1]
    plain = Engine(EngineConfig(share_every=2)).generate(PROMPTS[:2], 6)
    assert plain != outputs[0]


def test_bfloat16_engine_is_deterministic_and_context_dependent() -> None:
    config = EngineConfig(dtype="bfloat16", order="layer-hnd")
    prompt = make_prompts(1, 20, seed=9)[0]
    changed = [(prompt[0] + 1) % 512, *prompt[1:]]
    a = Engine(config).generate([prompt, changed], 6)
    b = Engine(config.__class__(dtype="bfloat16")).generate([prompt, changed], 6)
    assert a == b
    assert a[0] != a[1]
    assert Engine(config).kv_caches["layers.0.self_attn"].dtype == torch.bfloat16


def test_presets_match_the_proto_presets_and_build_layouts() -> None:
    tiny = EngineConfig.preset("tiny")
    assert tiny == EngineConfig()
    for name in ("tiny", "small"):
        shape, config = PRESETS[name], EngineConfig.preset(name)
        model = config.layout().model
        assert (model.num_layers, model.num_kv_heads, model.head_size, model.dtype) == (
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_size,
            shape.dtype,
        )
    assert tiny.layout().fingerprint() == EngineConfig().layout().fingerprint()
    assert tiny.layout().fingerprint() != EngineConfig(seed=1).layout().fingerprint()
    assert tiny.layout().fingerprint() == EngineConfig(order="layer-nhd").layout().fingerprint()


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("num_heads", 3),
        ("dtype", "float16"),
        ("order", "B L KV N H C"),
        ("block_size", 0),
        ("share_last", 3),
        ("head_size", 31),
    ],
)
def test_config_rejects_a_bad_knob_by_name(knob: str, value: object) -> None:
    with pytest.raises(ConfigError, match=knob):
        EngineConfig(**{knob: value})  # type: ignore[arg-type]


def test_unknown_preset_is_rejected() -> None:
    with pytest.raises(ConfigError, match="tiny"):
        EngineConfig.preset("huge")

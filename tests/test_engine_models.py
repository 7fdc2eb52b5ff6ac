"""The reference engine's KV-sharing (with prefill skip) and encoder-decoder models, in-process."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvbridge.proto import ConfigError
from kvbridge.worker.engine import Engine, EngineConfig
from tests.harness.engine import run_to_end

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(20, 60))] for _ in range(count)]


def assert_all_blocks_free(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine.has_held_blocks()
    for name, pool in engine.pools.items():
        assert engine.num_free_blocks(name) == pool.num_blocks, name


PROMPTS = prompts(3, seed=4)


@pytest.mark.parametrize("order", ["block-nhd", "layer-nhd"])
@pytest.mark.parametrize("pattern", [{"share_last": 2}, {"share_every": 2}])
def test_prefill_skip_gives_the_same_tokens_as_a_full_prefill(
    pattern: dict[str, int], order: str
) -> None:
    full = Engine(EngineConfig(order=order, **pattern)).generate(PROMPTS, 6)
    engine = Engine(EngineConfig(order=order, prefill_skip=True, **pattern))
    assert engine.generate(PROMPTS, 6) == full
    assert_all_blocks_free(engine)


def test_prefill_skip_runs_the_trailing_sharing_layers_on_the_last_prompt_token_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = Engine(EngineConfig.preset("share-tiny", prefill_skip=True))
    assert engine.model.tail_start == 4
    calls: list[tuple[int, int, int]] = []
    original = engine.model.run_layers

    def spy(x: torch.Tensor, start: int, first: int, stop: int, *a: Any, **k: Any) -> Any:
        calls.append((first, start, x.shape[0]))
        return original(x, start, first, stop, *a, **k)

    monkeypatch.setattr(engine.model, "run_layers", spy)
    prompt = prompts(1, seed=5)[0][:40]  # chunks 0-15, 16-31, 32-39
    engine.generate([prompt], 2)
    tail = [(start, n) for first, start, n in calls if first == 4]
    assert tail == [(39, 1), (40, 1)]  # the last prompt token, then one decode step
    head = [(start, n) for first, start, n in calls if first == 0]
    assert head == [(0, 16), (16, 16), (32, 8), (40, 1)]


def test_share_every_has_no_trailing_group_when_the_last_layer_owns_kv() -> None:
    assert EngineConfig(num_layers=4, share_every=2).tail_start == 3
    assert EngineConfig(num_layers=5, share_every=2).tail_start == 5
    assert EngineConfig().tail_start == 4


@pytest.mark.parametrize("pattern", [{"share_last": 2}, {"share_every": 2}])
def test_sharing_layers_own_no_bytes_and_blocks_hold_owning_layers_only(
    pattern: dict[str, int],
) -> None:
    engine = Engine(EngineConfig(order="layer-nhd", **pattern))
    layout = engine.layout
    owners = layout.owning_layers("self")
    assert len(owners) == 2
    assert layout.block_bytes("self") == 2 * 2 * layout.span_bytes
    assert len(layout.regions) == 2  # one registered region per owning layer, no alias twice
    for layer in layout.layers:
        if layer.kv_source is not None:
            assert engine.kv_caches[layer.name] is engine.kv_caches[layer.kv_source]


# ---------------------------------------------------------------- encoder-decoder

ENCDEC = EngineConfig.preset("encdec-tiny")
CLIP_A = bytes(range(40, 90))
CLIP_B = bytes(range(200, 233))


def test_encdec_layout_has_a_cross_group_with_one_layer_per_decoder_layer() -> None:
    layout = Engine(ENCDEC).layout
    assert [g.name for g in layout.groups] == ["self", "cross"]
    cross = [x.name for x in layout.layers if x.group == "cross"]
    assert cross == [f"layers.{i}.cross_attn" for i in range(4)]


@pytest.mark.parametrize("order", ["block-nhd", "layer-nhd"])
def test_a_repeated_encoder_input_reuses_its_cross_blocks_with_identical_output(
    order: str,
) -> None:
    config = EngineConfig.preset("encdec-tiny", order=order)
    cold = [Engine(config).generate([p], 5, [CLIP_A])[0] for p in PROMPTS[:2]]
    engine = Engine(config)
    engine.add_request(PROMPTS[0], 5, "first", encoder_input=CLIP_A)
    first = run_to_end(engine)["first"]
    engine.add_request(PROMPTS[1], 5, "second", encoder_input=CLIP_A)
    second = run_to_end(engine)["second"]
    assert [list(first.output_token_ids), list(second.output_token_ids)] == cold
    assert (first.cross_source, second.cross_source) == ("computed", "hit")
    assert first.cross_blocks == second.cross_blocks == -(-len(CLIP_A) // 16)
    assert engine.num_encoder_runs == 1
    assert_all_blocks_free(engine)


def test_the_encoder_input_changes_the_output_and_the_self_block_names() -> None:
    engine = Engine(ENCDEC)
    a, b = engine.generate([PROMPTS[0], PROMPTS[0]], 6, [CLIP_A, CLIP_B])
    assert a != b
    ra = engine.scheduler.add_request(PROMPTS[2], 2, "x", encoder_input=CLIP_A)
    rb = engine.scheduler.add_request(PROMPTS[2], 2, "y", encoder_input=CLIP_B)
    assert ra.block_hashes[0] != rb.block_hashes[0]
    assert ra.cross_hashes != rb.cross_hashes
    engine.abort("x")
    engine.abort("y")
    assert_all_blocks_free(engine)


def test_aborting_encdec_requests_frees_self_and_cross_blocks() -> None:
    engine = Engine(ENCDEC)
    engine.add_request(PROMPTS[0], 8, "waiting", encoder_input=CLIP_A)
    engine.add_request(PROMPTS[1], 8, "running", encoder_input=CLIP_B)
    engine.step()
    engine.step()
    assert engine.num_free_blocks("cross") < engine.pools["cross"].num_blocks
    assert engine.abort("running") is not None
    assert engine.abort("waiting") is not None
    while engine.has_held_blocks():
        engine.step()
    assert_all_blocks_free(engine)


def test_encoder_input_is_required_exactly_when_the_model_has_an_encoder() -> None:
    with pytest.raises(ConfigError, match="encoder_input"):
        Engine(ENCDEC).add_request(PROMPTS[0], 2)
    with pytest.raises(ConfigError, match="encoder_decoder off"):
        Engine(EngineConfig()).add_request(PROMPTS[0], 2, encoder_input=b"x")
    with pytest.raises(ConfigError, match="max_encoder_len"):
        Engine(ENCDEC).add_request(PROMPTS[0], 2, encoder_input=bytes(ENCDEC.max_encoder_len + 1))
    with pytest.raises(ConfigError, match="num_cross_blocks"):
        EngineConfig(encoder_decoder=True, num_cross_blocks=2, max_encoder_len=64)


def test_encdec_with_kv_sharing_and_prefill_skip_matches_without_skip() -> None:
    config = EngineConfig.preset("encdec-tiny", share_last=2)
    encs = [CLIP_A, CLIP_B, CLIP_A]
    full = Engine(config).generate(PROMPTS, 5, encs)
    engine = Engine(EngineConfig.preset("encdec-tiny", share_last=2, prefill_skip=True))
    assert engine.generate(PROMPTS, 5, encs) == full
    assert_all_blocks_free(engine)

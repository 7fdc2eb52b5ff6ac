"""The compiled CPU span copy (``kernels/cpu_spans.c``): one call per copy, bit-exact, and
the torch path where it does not apply. Bit-exactness over every order pair, dtype and op
is in tests/test_kernels.py, which runs each test with and without the span copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvbridge.kernels import (
    BlockMapping,
    convert_blocks,
    copy_blocks,
    cpu_spans,
    gather_blocks,
    scatter_blocks,
    torch_path,
)
from kvbridge.proto import KVGroup
from kvbridge.proto.presets import PresetShape, make_layout
from tests.harness.kernels import (
    assert_cache_equals,
    random_cache,
    reference_copy,
    reference_staging,
)

pytestmark = pytest.mark.skipif(
    not cpu_spans.available(), reason="the compiled span copy is not built here"
)

# 4 owning layers of 64-byte runs (head size 32, bfloat16), 6 blocks of 3 tokens
SHAPE = PresetShape("t", 4, 2, 32, "bfloat16")


def _layout(order: str, num_blocks: int = 6) -> Any:
    return make_layout(SHAPE, block_size=3, num_blocks=num_blocks, order=order)


class _Spy:
    """Records the helper's calls and forwards them."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []
        self.native = cpu_spans.native_module()

    def copy_spans(self, *args: int) -> None:
        self.calls.append(args)
        assert self.native is not None
        self.native.copy_spans(*args)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    s = _Spy()
    monkeypatch.setattr(cpu_spans, "native_module", lambda: s)
    return s


def test_the_span_copy_is_built_with_the_package() -> None:
    # pip builds it wherever a C compiler exists (CI's does); the torch path is the fallback
    assert cpu_spans.available()
    assert cpu_spans.native_module().__name__ == "kvbridge.kernels._cpu_spans"  # type: ignore[union-attr]


def test_a_per_layer_convert_is_one_call_for_every_layer_and_block(spy: _Spy) -> None:
    # layer-separate caches are one allocation per layer: still one call, one pair per layer
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    src, dst = random_cache(sl, 1), random_cache(dl, 2)
    pairs = [(5, 0), (1, 4), (5, 3), (2, 1)]  # no run on either side, a source read twice
    want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    (call,) = spy.calls
    npairs, nblocks, nruns, run = call[2], call[5], call[10], call[11]
    assert (npairs, nblocks) == (4, 4)
    # NHD -> HND: one head_size run (64 bytes) per (K/V, token, head) of a block
    assert (nruns, run) == (2 * 3 * 2, 64)


def test_work_is_split_between_torchs_threads_bit_exact(
    spy: _Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_spans, "PART_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    sl, dl = _layout("block-nhd"), _layout("layer-kv-nhd")
    src, dst = random_cache(sl, 3), random_cache(dl, 4)
    pairs = [(0, 5), (3, 2), (4, 0), (1, 1)]
    want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
    convert_blocks(src, sl, dst, dl, BlockMapping([p[0] for p in pairs], [p[1] for p in pairs]))
    assert_cache_equals(dst, want, dl)
    assert [c[12] for c in spy.calls] == [3]


def test_runs_shorter_than_the_minimum_are_left_to_torch(
    spy: _Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    fallback = torch_path.copy_pairs

    def torch_copy(*args: Any) -> None:
        calls.append(1)
        fallback(*args)

    monkeypatch.setattr(cpu_spans, "MIN_RUN_BYTES", 128)  # the 64-byte NHD -> HND runs
    monkeypatch.setattr("kvbridge.kernels.ops.copy_pairs", torch_copy)
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    src, dst = random_cache(sl, 5), random_cache(dl, 6)
    pairs = [(5, 0), (1, 4)]
    want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    assert spy.calls == [] and calls == [1]


def test_a_copy_that_may_overlap_itself_never_takes_the_span_copy(spy: _Spy) -> None:
    layout = _layout("layer-nhd")
    cache = random_cache(layout, 7)
    pairs = [(0, 1), (1, 2), (2, 0)]  # a rotation: every source is also a destination
    want = reference_copy(cache, layout, cache, pairs, KVGroup.SELF)
    copy_blocks(cache, cache, layout, pairs)
    assert_cache_equals(cache, want, layout)
    assert spy.calls == []


def test_gather_from_per_layer_tensors_is_one_call(spy: _Spy) -> None:

    layout = _layout("layer-hnd")
    cache = random_cache(layout, 8)
    staging = torch.zeros(layout.block_bytes() * 3, dtype=torch.uint8)
    gather_blocks(cache, layout, [4, 0, 4], staging)
    assert torch.equal(staging, reference_staging(cache, layout, [4, 0, 4], KVGroup.SELF))
    assert len(spy.calls) == 1


def test_big_copies_of_short_runs_stream_and_others_do_not(
    spy: _Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    src = random_cache(sl, 9)
    pairs = [(5, 0), (1, 4)]  # 2 blocks x 4 layers x 12 runs of 64 bytes: 6 KiB
    monkeypatch.setattr(cpu_spans, "STREAM_BYTES", 6 << 10)
    for min_run in (64, 65):  # the 64-byte runs stream, then are too short to
        monkeypatch.setattr(cpu_spans, "STREAM_MIN_RUN", min_run)
        dst = random_cache(dl, 10)
        want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
        convert_blocks(src, sl, dst, dl, pairs)
        assert_cache_equals(dst, want, dl)
    monkeypatch.setattr(cpu_spans, "STREAM_BYTES", (6 << 10) + 1)  # one byte too few
    convert_blocks(src, sl, random_cache(dl, 11), dl, pairs)
    assert [c[13] for c in spy.calls] == [True, False, False]


@pytest.mark.parametrize("offset", [1, 3, 17])
def test_streamed_runs_are_exact_at_any_alignment(
    spy: _Spy, monkeypatch: pytest.MonkeyPatch, offset: int
) -> None:
    # 1-byte elements and a staging buffer starting `offset` bytes into its allocation: the
    # streamed stores meet unaligned heads and tails on the staging side, read and written
    shape = PresetShape("t", 4, 2, 40, "float8_e4m3fn")  # 40-byte runs
    layout = make_layout(shape, block_size=3, num_blocks=6, order="layer-hnd")
    monkeypatch.setattr(cpu_spans, "STREAM_BYTES", 0)
    monkeypatch.setattr(cpu_spans, "STREAM_MIN_RUN", 0)
    cache = random_cache(layout, 12)
    ids = [4, 0, 2]
    raw = torch.zeros(layout.block_bytes() * 3 + offset, dtype=torch.uint8)
    staging = raw[offset:]
    gather_blocks(cache, layout, ids, staging)
    assert torch.equal(staging, reference_staging(cache, layout, ids, KVGroup.SELF))
    assert torch.equal(raw[:offset], torch.zeros(offset, dtype=torch.uint8))
    back = random_cache(layout, 13)
    scatter_blocks(staging, back, layout, [1, 5, 3])
    want = reference_copy(cache, layout, back, list(zip(ids, [1, 5, 3], strict=True)), KVGroup.SELF)
    assert_cache_equals(back, want, layout)
    assert [c[13] for c in spy.calls] == [True, True]

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
from kvbridge.proto import KVGroup, LayoutError
from kvbridge.proto.presets import PresetShape, make_layout
from tests.harness.kernels import (
    assert_cache_equals,
    bits,
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


# ----- plans kept between calls (kernels/cpu_plan.py) ---------------------------------------
@pytest.fixture
def view_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the group-view builds of kvbridge.kernels.ops (one per cache side)."""
    from kvbridge.kernels import cpu_plan, ops

    cpu_plan.clear()
    builds: list[int] = []
    real = ops.group_views

    def counted(*args: Any) -> Any:
        builds.append(1)
        return real(*args)

    monkeypatch.setattr(ops, "group_views", counted)
    return builds


def test_a_kept_plan_is_reused_for_the_same_tensors_bit_exact(
    spy: _Spy, view_builds: list[int]
) -> None:
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    src, dst = random_cache(sl, 20), random_cache(dl, 21)
    for pairs in ([(5, 0), (1, 4)], [(0, 2), (3, 3), (2, 5)], [(4, 1)]):
        want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
        convert_blocks(src, sl, dst, dl, pairs)
        assert_cache_equals(dst, want, dl)
    assert len(view_builds) == 2 and len(spy.calls) == 3  # views built by the first call only


def test_a_tensor_replaced_or_changed_in_place_gets_a_new_plan(
    spy: _Spy, view_builds: list[int]
) -> None:
    layout = _layout("layer-kv-nhd")
    src, dst = random_cache(layout, 22), random_cache(layout, 23)
    pairs = [(5, 0), (1, 4)]
    copy_blocks(src, dst, layout, pairs)
    name = layout.owning_layers(KVGroup.SELF)[2].name
    # another tensor under a layer's name, then the same tensor object moved to new memory
    dst[name] = dst[name].clone()
    moved = random_cache(layout, 24)[name]
    src[name].set_(moved.untyped_storage(), moved.storage_offset(), moved.shape, moved.stride())
    for _ in range(2):
        want = reference_copy(src, layout, dst, pairs, KVGroup.SELF)
        copy_blocks(src, dst, layout, pairs)
        assert_cache_equals(dst, want, layout)
    assert len(view_builds) == 4  # built again once for the new facts, then kept
    # a tensor restrided in place no longer fits the layout: the checks run again and refuse
    dst[name].as_strided_((2, 6, 3, 2, 16), dst[name].stride())
    with pytest.raises(LayoutError, match="shape"):
        copy_blocks(src, dst, layout, pairs)


def test_overlap_is_decided_per_call_with_a_kept_plan(spy: _Spy, view_builds: list[int]) -> None:
    layout = _layout("layer-nhd")
    cache = random_cache(layout, 25)
    for pairs in ([(0, 3), (1, 4)], [(0, 1), (1, 2), (2, 0)], [(5, 2)]):
        want = reference_copy(cache, layout, cache, pairs, KVGroup.SELF)
        copy_blocks(cache, cache, layout, pairs)
        assert_cache_equals(cache, want, layout)
    assert len(spy.calls) == 2  # the rotation (every source also a destination) took torch


def test_ids_are_checked_on_every_call_with_a_kept_plan(spy: _Spy) -> None:
    sl, dl = _layout("block-nhd"), _layout("layer-hnd")
    src, dst = random_cache(sl, 26), random_cache(dl, 27)
    convert_blocks(src, sl, dst, dl, [(1, 2)])
    before = {k: bits(v).clone() for k, v in dst.items()}
    with pytest.raises(LayoutError, match="more than once"):
        convert_blocks(src, sl, dst, dl, [(1, 2), (3, 2)])
    with pytest.raises(LayoutError, match="outside"):
        convert_blocks(src, sl, dst, dl, [(6, 0)])
    for k, v in dst.items():
        assert torch.equal(bits(v), before[k])  # bit patterns: NaNs compare unequal
    assert len(spy.calls) == 1


def test_non_contiguous_and_narrow_ids_move_the_right_blocks(spy: _Spy) -> None:
    sl, dl = _layout("layer-nhd"), _layout("block-hnd")
    src, dst = random_cache(sl, 28), random_cache(dl, 29)
    s_ids = torch.tensor([5, 9, 1, 9, 3, 9])[::2]  # int64, every other element: 5, 1, 3
    d_ids = torch.tensor([0, 4, 2], dtype=torch.int32)
    want = reference_copy(src, sl, dst, [(5, 0), (1, 4), (3, 2)], KVGroup.SELF)
    convert_blocks(src, sl, dst, dl, (s_ids, d_ids))
    assert_cache_equals(dst, want, dl)
    staging = torch.zeros(sl.block_bytes() * 3, dtype=torch.uint8)
    gather_blocks(src, sl, s_ids, staging)
    assert torch.equal(staging, reference_staging(src, sl, [5, 1, 3], KVGroup.SELF))


@pytest.mark.parametrize("head_size", [24, 48, 200])  # runs of 48, 96 and 400 bytes
@pytest.mark.parametrize("threads", [1, 3])
def test_streamed_claimed_copies_of_odd_run_lengths_are_exact(
    spy: _Spy, monkeypatch: pytest.MonkeyPatch, head_size: int, threads: int
) -> None:
    # every call streamed and split into one-unit parts between `threads` threads; runs that
    # are no multiple of 64 bytes, and a staging buffer 8 bytes off 32-byte alignment
    monkeypatch.setattr(cpu_spans, "STREAM_BYTES", 0)
    monkeypatch.setattr(cpu_spans, "STREAM_MIN_RUN", 0)
    monkeypatch.setattr(cpu_spans, "PART_BYTES", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    shape = PresetShape("t", 4, 2, head_size, "float16")
    sl = make_layout(shape, block_size=3, num_blocks=9, order="layer-nhd")
    dl = make_layout(shape, block_size=3, num_blocks=9, order="layer-hnd")
    src, dst = random_cache(sl, 30), random_cache(dl, 31)
    pairs = [(8, 0), (1, 4), (5, 3), (2, 8), (0, 1), (7, 6)]
    want = reference_copy(src, sl, dst, pairs, KVGroup.SELF)
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    raw = torch.zeros(dl.block_bytes() * 4 + 8, dtype=torch.uint8)
    staging = raw[8:] if raw.data_ptr() % 32 == 0 else raw[: dl.block_bytes() * 4]
    gather_blocks(dst, dl, [6, 0, 8, 6], staging)
    assert torch.equal(staging, reference_staging(dst, dl, [6, 0, 8, 6], KVGroup.SELF))
    assert [c[12] for c in spy.calls] == [threads, threads]
    assert all(c[13] for c in spy.calls)


def test_threads_sharing_the_kept_plans_copy_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from kvbridge.kernels import cpu_plan

    monkeypatch.setattr(cpu_plan, "MAX_PLANS", 2)  # threads evict each other's plans too
    sl, dl = _layout("layer-nhd"), _layout("layer-hnd")
    jobs = [(random_cache(sl, 40 + i), random_cache(dl, 50 + i)) for i in range(4)]
    pairs = [(5, 0), (1, 4), (2, 2)]
    wants = [reference_copy(src, sl, dst, pairs, KVGroup.SELF) for src, dst in jobs]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(30):
                convert_blocks(jobs[i][0], sl, jobs[i][1], dl, pairs)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for (_, dst), want in zip(jobs, wants, strict=True):
        assert_cache_equals(dst, want, dl)

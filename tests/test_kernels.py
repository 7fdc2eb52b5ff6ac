"""Behaviour of kvbridge.kernels on CPU: bit-exact against a per-block logical reference.

Every test runs twice: with the compiled span copy (``kernels/cpu_spans.c``, taking even
these tests' short runs) and with the torch path that runs where it is not built.
"""

from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.kernels import (
    BlockMapping,
    convert_blocks,
    copy_blocks,
    gather_blocks,
    scatter_blocks,
    staging_nbytes,
)
from kvbridge.proto import ORDERS, IncompatibleLayoutError, KVLayout, LayoutError
from kvbridge.proto.presets import PresetShape, make_layout, preset_layout
from tests.harness.fresh import run_python
from tests.harness.kernels import (
    Cache,
    assert_cache_equals,
    bits,
    random_cache,
    reference_copy,
    reference_staging,
    snapshot,
)

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def small(dtype: str = "bfloat16", **kw: int | bool) -> PresetShape:
    """4 layers (every 2nd shares KV) x 2 heads x 8 head size unless overridden."""
    args: dict[str, object] = {"share_every": 2, **kw}
    return PresetShape("t", 4, 2, 8, dtype, **args)  # type: ignore[arg-type]


def layout_of(shape: PresetShape, order: str, num_blocks: int = 6, **kw: int) -> KVLayout:
    return make_layout(shape, block_size=3, num_blocks=num_blocks, order=order, **kw)


@pytest.fixture(autouse=True, params=["span copy", "span copy streamed", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from kvbridge.kernels import cpu_spans

    if request.param == "torch":
        monkeypatch.setattr(cpu_spans, "native_module", lambda: None)
    else:
        if not cpu_spans.available():
            pytest.skip("the compiled span copy is not built (no C compiler at install)")
        monkeypatch.setattr(cpu_spans, "MIN_RUN_BYTES", 1)  # these test blocks are tiny
        if request.param == "span copy streamed":  # every run, of any length and alignment
            monkeypatch.setattr(cpu_spans, "STREAM_BYTES", 0)
            monkeypatch.setattr(cpu_spans, "STREAM_MIN_RUN", 0)
    return str(request.param)


# ----- conversion between every pair of orders ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("src_order", "dst_order"), list(itertools.product(ORDERS, ORDERS)))
def test_convert_is_bit_exact_for_every_pair_of_orders(
    src_order: str, dst_order: str, dtype: str
) -> None:
    shape = small(dtype)
    sl, dl = layout_of(shape, src_order, 7), layout_of(shape, dst_order, 5)
    src, dst = random_cache(sl, 1), random_cache(dl, 2)
    pairs = [(6, 0), (2, 3), (2, 4), (0, 1)]
    want = reference_copy(src, sl, dst, pairs, "self")
    before_src = snapshot(src)
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    assert_cache_equals(src, before_src, sl)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    src_order=st.sampled_from(sorted(ORDERS)),
    dst_order=st.sampled_from(sorted(ORDERS)),
    dtype=st.sampled_from(DTYPES),
    share=st.sampled_from([{}, {"share_every": 2}, {"share_last": 1}]),
)
def test_convert_random_mappings_match_reference(
    data: st.DataObject, src_order: str, dst_order: str, dtype: str, share: dict[str, int]
) -> None:
    shape = PresetShape("t", 3, 2, 4, dtype, **share)  # type: ignore[arg-type]
    sl, dl = layout_of(shape, src_order, 5), layout_of(shape, dst_order, 6)
    dst_ids = data.draw(st.lists(st.integers(0, 5), max_size=6, unique=True))
    src_ids = data.draw(st.lists(st.integers(0, 4), min_size=len(dst_ids), max_size=len(dst_ids)))
    pairs = list(zip(src_ids, dst_ids, strict=True))
    src, dst = random_cache(sl, 3), random_cache(dl, 4)
    want = reference_copy(src, sl, dst, pairs, "self")
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)


# ----- copy within one layout --------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", list(ORDERS))
def test_copy_blocks_between_two_caches_is_bit_exact(order: str, dtype: str) -> None:
    layout = layout_of(small(dtype), order)
    src, dst = random_cache(layout, 5), random_cache(layout, 6)
    pairs = [(1, 0), (1, 5), (4, 2)]
    want = reference_copy(src, layout, dst, pairs, "self")
    copy_blocks(src, dst, layout, pairs)
    assert_cache_equals(dst, want, layout)


@pytest.mark.parametrize("order", list(ORDERS))
def test_copy_within_one_cache_reads_every_source_before_writing(order: str) -> None:
    layout = layout_of(small("float32"), order)
    cache = random_cache(layout, 7)
    pairs = [(0, 1), (1, 2), (2, 0), (3, 3)]  # a rotation plus a self-copy
    want = reference_copy(cache, layout, cache, [], "self")
    for layer in layout.owning_layers("self"):
        for s, d in pairs:
            want[layer.name][:, d] = bits(cache[layer.name])[:, s].clone()
    copy_blocks(cache, cache, layout, pairs)
    assert_cache_equals(cache, want, layout)


def test_copy_in_chunks_matches_one_shot(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.kernels import torch_path

    layout = layout_of(small("float16"), "layer-kv-nhd", num_blocks=9)
    src, dst = random_cache(layout, 8), random_cache(layout, 9)
    pairs = [(i, 8 - i) for i in range(9)]
    want = reference_copy(src, layout, dst, pairs, "self")
    monkeypatch.setattr(torch_path, "CHUNK_BYTES", 1)  # one block per step
    copy_blocks(src, dst, layout, pairs)
    assert_cache_equals(dst, want, layout)


@pytest.mark.parametrize("preset", ["kv-share-third", "kv-share-every2"])
@pytest.mark.parametrize(
    ("src_order", "dst_order"), [("block-nhd", "layer-hnd"), ("layer-kv-nhd", "block-hnd")]
)
def test_kv_sharing_presets_copy_owning_layers_once(
    preset: str, src_order: str, dst_order: str
) -> None:
    sl = preset_layout(preset, block_size=2, num_blocks=4, order=src_order)
    dl = preset_layout(preset, block_size=2, num_blocks=3, order=dst_order)
    src, dst = random_cache(sl, 10), random_cache(dl, 11)
    pairs = [(3, 0), (0, 2)]
    want = reference_copy(src, sl, dst, pairs, "self")
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    sharing = [x for x in dl.layers if x.kv_source is not None]
    assert sharing and all(dst[x.name] is dst[x.kv_source] for x in sharing)  # type: ignore[index]


@pytest.mark.parametrize(
    ("src_order", "dst_order"), [("block-nhd", "layer-hnd"), ("layer-nhd", "layer-nhd")]
)
def test_encoder_decoder_cross_group_is_copied_by_its_own_ids(
    src_order: str, dst_order: str
) -> None:
    shape = PresetShape("ed", 2, 2, 4, "bfloat16", encoder_decoder=True)
    sl = make_layout(shape, block_size=2, num_blocks=5, num_cross_blocks=3, order=src_order)
    dl = make_layout(shape, block_size=2, num_blocks=4, num_cross_blocks=2, order=dst_order)
    src, dst = random_cache(sl, 12), random_cache(dl, 13)
    before = snapshot(dst)
    pairs = [(2, 1), (0, 0)]
    want = reference_copy(src, sl, dst, pairs, "cross")
    convert_blocks(src, sl, dst, dl, pairs, group="cross")
    assert_cache_equals(dst, want, dl)
    for layer in dl.owning_layers("self"):  # the self group is untouched
        assert torch.equal(bits(dst[layer.name]), before[layer.name])
    with pytest.raises(LayoutError, match=re.escape("outside 0..1")):
        convert_blocks(src, sl, dst, dl, [(0, 2)], group="cross")


def test_per_layer_allocations_are_handled_layer_by_layer() -> None:
    layout = layout_of(small("float32"), "layer-nhd")
    s = layout.sizes("self")
    own = {x.name for x in layout.owning_layers("self")}
    separate: Cache = {}
    for x in layout.layers:
        if x.kv_source is None:
            t = torch.randn(s["B"], 2, s["N"], s["H"], s["C"]).permute(1, 0, 2, 3, 4)
            separate[x.name] = t
        else:
            separate[x.name] = separate[x.kv_source]
    assert len(own) == 2
    other = random_cache(layout_of(small("float32"), "block-hnd"), 14)
    want = reference_copy(separate, layout, other, [(0, 5), (5, 0)], "self")
    convert_blocks(
        separate, layout, other, layout_of(small("float32"), "block-hnd"), [(0, 5), (5, 0)]
    )
    assert_cache_equals(other, want, layout_of(small("float32"), "block-hnd"))


# ----- gather / scatter ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", list(ORDERS))
def test_gather_writes_the_documented_staging_bytes(order: str, dtype: str) -> None:
    layout = layout_of(small(dtype), order)
    cache = random_cache(layout, 15)
    ids = [4, 0, 4, 2]
    staging = torch.full((staging_nbytes(layout, len(ids)) + 5,), 7, dtype=torch.uint8)
    gather_blocks(cache, layout, ids, staging)
    assert torch.equal(staging[:-5], reference_staging(cache, layout, ids, "self"))
    assert staging[-5:].tolist() == [7] * 5  # nothing past the blocks is written


def test_block_outermost_staging_is_the_blocks_own_bytes() -> None:
    layout = layout_of(small("bfloat16", share_every=0), "block-nhd")
    cache = random_cache(layout, 16)
    base = cache[layout.owning_layers("self")[0].name]
    memory = base.as_strided((layout.group_bytes("self") // 2,), (1,)).view(torch.uint8)
    bb = layout.block_bytes()
    staging = torch.empty(2 * bb, dtype=torch.uint8)
    gather_blocks(cache, layout, torch.tensor([3, 1]), staging)
    assert torch.equal(staging[:bb], memory[3 * bb : 4 * bb])
    assert torch.equal(staging[bb:], memory[bb : 2 * bb])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("src_order", "dst_order"),
    [("block-nhd", "layer-kv-nhd"), ("layer-hnd", "block-hnd"), ("layer-nhd", "layer-nhd")],
)
def test_scatter_inverts_gather(src_order: str, dst_order: str, dtype: str) -> None:
    sl = layout_of(small(dtype), src_order)
    dl = layout_of(small(dtype), dst_order)
    src, dst = random_cache(sl, 17), random_cache(dl, 18)
    ids_src, ids_dst = [5, 1, 1], [0, 3, 2]
    # the staging block order depends on the inner order: gather/scatter within one layout
    staging = torch.empty(staging_nbytes(sl, 3), dtype=torch.uint8)
    gather_blocks(src, sl, ids_src, staging)
    back = random_cache(sl, 19)
    want = reference_copy(src, sl, back, list(zip(ids_src, ids_dst, strict=True)), "self")
    scatter_blocks(staging, back, sl, ids_dst)
    assert_cache_equals(back, want, sl)
    typed = torch.empty(
        staging_nbytes(dl, 3) // dl.model.dtype_bytes, dtype=dst[dl.layers[0].name].dtype
    )
    convert_blocks(src, sl, dst, dl, [(5, 0)])
    gather_blocks(dst, dl, [0, 0, 0], typed)
    assert torch.equal(typed.view(torch.uint8), reference_staging(dst, dl, [0, 0, 0], "self"))


# ----- mapping forms and rejection -----------------------------------------------------------
@pytest.mark.parametrize(
    "mapping",
    [
        [(3, 0), (1, 2)],
        [[3, 0], [1, 2]],
        torch.tensor([[3, 0], [1, 2]]),
        torch.tensor([[3, 0], [1, 2]], dtype=torch.int32),
        np.array([[3, 0], [1, 2]]),
        BlockMapping([3, 1], [0, 2]),
        BlockMapping(torch.tensor([3, 1]), torch.tensor([0, 2])),
        (torch.tensor([3, 1]), torch.tensor([0, 2])),
        (np.array([3, 1]), np.array([0, 2])),
    ],
)
def test_every_mapping_form_means_the_same_pairs(mapping: object) -> None:
    layout = layout_of(small("float32"), "block-nhd")
    src, dst = random_cache(layout, 20), random_cache(layout, 21)
    want = reference_copy(src, layout, dst, [(3, 0), (1, 2)], "self")
    copy_blocks(src, dst, layout, mapping)  # type: ignore[arg-type]
    assert_cache_equals(dst, want, layout)


def test_empty_mapping_is_a_no_op() -> None:
    layout = layout_of(small("float32"), "layer-nhd")
    src, dst = random_cache(layout, 22), random_cache(layout, 23)
    before = snapshot(dst)
    copy_blocks(src, dst, layout, [])
    gather_blocks(src, layout, [], torch.empty(0, dtype=torch.uint8))
    scatter_blocks(torch.empty(0, dtype=torch.uint8), dst, layout, [])
    assert_cache_equals(dst, before, layout)


@pytest.mark.parametrize(
    ("mapping", "match"),
    [
        ([(0, 6)], "block id 6 of group 'self' is outside 0..5"),
        ([(-1, 0)], "block id -1"),
        ([(0, 1), (2, 1)], "appears more than once"),
        ([(0.0, 1)], "not an integer"),
        ([(True, 1)], "not an integer"),
        ([(0, 1, 2)], "not a \\(src, dst\\) pair"),
        (torch.zeros(2, 3, dtype=torch.int64), "shape \\(n, 2\\)"),
        (torch.zeros(2, 2), "must be integers"),
        (BlockMapping([0, 1], [2]), "equal length"),
        ([(2**70, 1)], "not a list of block ids"),
        (np.array([[0, 1]], dtype=object), "not a list of block ids"),
        (BlockMapping([0], 5), "not a list of block ids"),  # type: ignore[arg-type]
    ],
)
def test_bad_mappings_are_rejected_before_any_write(mapping: object, match: str) -> None:
    layout = layout_of(small("float32"), "block-hnd")
    src, dst = random_cache(layout, 24), random_cache(layout, 25)
    before = snapshot(dst)
    with pytest.raises(LayoutError, match=match):
        copy_blocks(src, dst, layout, [(1, 1), *mapping] if isinstance(mapping, list) else mapping)  # type: ignore[arg-type]
    assert_cache_equals(dst, before, layout)


@pytest.mark.parametrize("count", [3, 2000])  # checked in Python / by torch ops
def test_long_and_short_id_lists_are_rejected_alike(count: int) -> None:
    layout = layout_of(small("float32"), "block-hnd", num_blocks=4096)
    src, dst = random_cache(layout, 28), random_cache(layout, 29)
    before = snapshot(dst)
    ids = list(range(10, 10 + count))
    for s_ids, d_ids, match in [
        ([*ids[:-1], 4096], ids, "block id 4096 of group 'self' is outside 0..4095"),
        (ids, [*ids[:-1], -3], "block id -3"),
        (ids, [12, *ids[1:-2], 11, 11], "block id 11 of group 'self' appears more than once"),
    ]:
        with pytest.raises(LayoutError, match=match):
            copy_blocks(src, dst, layout, BlockMapping(s_ids, d_ids))
    assert_cache_equals(dst, before, layout)


def test_incompatible_layouts_name_the_field_and_leave_dst_alone() -> None:
    sl = layout_of(small("float32"), "block-nhd")
    dl = layout_of(PresetShape("t", 4, 2, 16, "float32", share_every=2), "layer-nhd")
    src, dst = random_cache(sl, 26), random_cache(dl, 27)
    before = snapshot(dst)
    with pytest.raises(IncompatibleLayoutError, match=re.escape("model.head_size differs")):
        convert_blocks(src, sl, dst, dl, [(0, 0)])
    assert_cache_equals(dst, before, dl)


def test_bad_caches_and_staging_are_rejected_before_any_write() -> None:
    layout = layout_of(small("float32"), "layer-nhd")
    src, dst = random_cache(layout, 28), random_cache(layout, 29)
    before = snapshot(dst)
    missing = {k: v for k, v in src.items() if k != "layers.0.self_attn"}
    with pytest.raises(
        LayoutError, match=re.escape("no tensor for owning layer 'layers.0.self_attn'")
    ):
        copy_blocks(missing, dst, layout, [(0, 0)])
    wrong_dtype = {k: v.to(torch.float64) for k, v in src.items()}
    with pytest.raises(LayoutError, match=re.escape("dtype torch.float64")):
        copy_blocks(wrong_dtype, dst, layout, [(0, 0)])
    with pytest.raises(LayoutError, match="no group 'cross'"):
        copy_blocks(src, dst, layout, [(0, 0)], group="cross")
    with pytest.raises(LayoutError, match="need"):
        scatter_blocks(torch.zeros(10, dtype=torch.uint8), dst, layout, [0])
    with pytest.raises(LayoutError, match="dtype"):
        scatter_blocks(torch.zeros(10_000, dtype=torch.int32), dst, layout, [0])
    with pytest.raises(LayoutError, match="appears more than once"):
        scatter_blocks(torch.zeros(10_000, dtype=torch.uint8), dst, layout, [1, 1])
    with pytest.raises(LayoutError, match="outside"):
        gather_blocks(src, layout, [9], torch.zeros(10_000, dtype=torch.uint8))
    assert_cache_equals(dst, before, layout)


def test_cpu_calls_never_import_cupy_and_a_bare_import_loads_no_torch() -> None:
    code = (
        "import sys, kvbridge.kernels as k; light = 'torch' not in sys.modules;"
        "from kvbridge.proto.presets import preset_layout;"
        "lay = preset_layout('tiny', num_blocks=4); c = lay.allocate();"
        "k.copy_blocks(c, lay.allocate(), lay, [(0, 1)]); print(light, 'cupy' in sys.modules)"
    )
    out = run_python(code)
    assert out.split() == ["True", "False"]


@pytest.mark.parametrize("runs", ["dst", "src"])
def test_copy_with_consecutive_ids_on_one_side_is_exact(runs: str) -> None:
    layout = layout_of(small("bfloat16"), "layer-nhd", num_blocks=8)
    src, dst = random_cache(layout, 30), random_cache(layout, 31)
    pairs = [(7, 2), (1, 3), (4, 4)] if runs == "dst" else [(2, 7), (3, 1), (4, 0)]
    want = reference_copy(src, layout, dst, pairs, "self")
    copy_blocks(src, dst, layout, pairs)
    assert_cache_equals(dst, want, layout)


def _forbid_two_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block slice is moved by one strided copy: no index op, no temporary (the torch
    path: the compiled span copy is switched off)."""
    from kvbridge.kernels import cpu_spans, torch_path

    monkeypatch.setattr(cpu_spans, "native_module", lambda: None)

    def index_op(*args: object, **kwargs: object) -> None:
        raise AssertionError("took an index op (index_select / index_copy_)")

    monkeypatch.setattr(torch_path, "SLICE_BYTES", 1)  # these test blocks are tiny
    for name in ("copy_rows", "gather_rows", "scatter_rows"):
        monkeypatch.setattr(torch_path, name, index_op)


@pytest.mark.parametrize(("src_order", "dst_order"), list(itertools.product(ORDERS, ORDERS)))
def test_cpu_convert_is_one_strided_copy_per_block_and_bit_exact(
    src_order: str, dst_order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_two_passes(monkeypatch)
    shape = small("bfloat16")
    sl, dl = layout_of(shape, src_order, 8), layout_of(shape, dst_order, 8)
    src, dst = random_cache(sl, 40), random_cache(dl, 41)
    pairs = [(5, 0), (1, 6), (5, 3), (7, 1)]  # no run of ids on either side, a source read twice
    want = reference_copy(src, sl, dst, pairs, "self")
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)


def test_small_cpu_block_copies_are_split_between_torchs_threads_bit_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvbridge.kernels import torch_path

    callers: list[int] = []  # one entry per part (a finished helper's id may be reused)
    foreach = torch._foreach_copy_

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        callers.append(threading.get_ident())
        foreach(dsts, srcs)

    _forbid_two_passes(monkeypatch)
    # a slice here is 384 bytes (48 int64): each a one-thread copy, all together several grains
    monkeypatch.setattr(torch_path, "GRAIN_ELEMS", 64)
    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    shape = small("float32")
    sl, dl = layout_of(shape, "layer-nhd", 8), layout_of(shape, "layer-hnd", 8)
    src, dst = random_cache(sl, 44), random_cache(dl, 45)
    pairs = [(5, 0), (1, 6), (5, 3), (7, 1), (2, 2)]
    want = reference_copy(src, sl, dst, pairs, "self")
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    assert len(callers) == 3 and threading.get_ident() in callers
    assert len(set(callers)) >= 2  # the calling thread did one part, helpers the others


# ----- the CUDA span table, executed on the host -------------------------------------------
@pytest.mark.parametrize("kind", ["copy", "gather"])
@pytest.mark.parametrize(
    ("src_order", "dst_order"),
    [(a, b) for a, b in itertools.product(ORDERS, ORDERS) if ORDERS[a][3:] == ORDERS[b][3:]],
)
def test_span_table_addresses_the_right_bytes(
    src_order: str, dst_order: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run the span table the CUDA kernel would get with memmove over CPU memory."""
    import ctypes

    from kvbridge.kernels import cuda_path
    from kvbridge.kernels.views import coalesce, group_views, paired_views, staging_view, widen

    monkeypatch.setattr(cuda_path, "PIECE_BYTES", 32)  # exercise span splitting too
    shape = PresetShape("t", 4, 2, 8, "float16", share_every=2)
    sl, dl = layout_of(shape, src_order, 7), layout_of(shape, dst_order, 5)
    src, dst = random_cache(sl, 32), random_cache(dl, 33)
    pairs = [(6, 0), (2, 3), (2, 4)]
    s_ids, d_ids = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    if kind == "copy":
        want = reference_copy(src, sl, dst, pairs, "self")
        views = paired_views(group_views(src, sl, "self"), group_views(dst, dl, "self"))
    else:
        staging = torch.zeros(staging_nbytes(sl, 3), dtype=torch.uint8)
        views = paired_views(
            group_views(src, sl, "self"), [staging_view(staging, sl, "self", 3, "s")]
        )
        d_ids = torch.arange(3)
    tables = []
    for a, b in views:
        wa, wb = widen(coalesce([a, b], lead=1))
        assert cuda_path.spans_apply(wa, wb, 0) or wa.shape[-1] * wa.element_size() < 256
        tables.append(cuda_path.build_spans(wa, wb, 0, s_ids, d_ids))
    table = torch.cat(tables)
    assert int(table[:, 2].max()) <= 32
    for s_addr, d_addr, length in table.tolist():
        ctypes.memmove(d_addr, s_addr, length)
    if kind == "copy":
        assert_cache_equals(dst, want, dl)
    else:
        assert torch.equal(staging, reference_staging(src, sl, [6, 2, 2], "self"))


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize(
    ("src_order", "dst_order"),
    [
        ("KV B L N H C", "block-nhd"),
        ("layer-hnd", "B KV L C H N"),
        ("KV L B H C N", "KV B L N H C"),
    ],
)
def test_mixed_orders_outside_the_presets_convert_and_stage_exactly(
    src_order: str, dst_order: str, dtype: str
) -> None:
    shape = small(dtype)
    sl, dl = layout_of(shape, src_order, 5), layout_of(shape, dst_order, 4)
    src, dst = random_cache(sl, 34), random_cache(dl, 35)
    pairs = [(4, 0), (1, 3)]
    want = reference_copy(src, sl, dst, pairs, "self")
    convert_blocks(src, sl, dst, dl, pairs)
    assert_cache_equals(dst, want, dl)
    staging = torch.empty(staging_nbytes(dl, 2), dtype=torch.uint8)
    gather_blocks(dst, dl, [3, 0], staging)
    assert torch.equal(staging, reference_staging(dst, dl, [3, 0], "self"))


def test_block_outermost_copy_is_one_index_op_over_a_block_matrix() -> None:
    from kvbridge.kernels.views import coalesce, group_views, widen

    layout = preset_layout("kv-share-third", block_size=2, num_blocks=4, order="block-nhd")
    cache = layout.allocate()
    (view,) = group_views(cache, layout, "self")
    a, _ = widen(coalesce([view, view]))
    assert a.shape == (4, layout.block_bytes() // 8) and a.dtype == torch.int64
    assert a.is_contiguous() and a.data_ptr() == cache["layers.0.self_attn"].data_ptr()

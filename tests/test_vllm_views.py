"""vLLM's per-layer KV views -> kvbridge layouts, without vLLM.

The tensors are built the way vLLM 0.32 builds them (``create_kv_cache_views``):
one flat int8 buffer, byte strides from the layout's stride order over the
logical ``[L, B, H, N, 2C]`` shape, one ``as_strided`` view per layer, then
viewed as the model dtype.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvbridge.connector.transport.nixl_descs import (
    descriptor_indices,
    descriptor_table,
    request_indices,
    strided_indices,
    strided_table,
)
from kvbridge.connector.vllm.config import VllmConnectorConfig, required_layout
from kvbridge.connector.vllm.views import PACKED_SUFFIX, logical_views, packed_suffix
from kvbridge.proto import ConfigError, KVLayout, LayoutError, TransferMode
from tests.harness.descs import expand_strided

# vLLM's KVCacheLayout stride orders over logical [L, B, H, N, C]
STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
L, B, H, N, C = 3, 5, 2, 32, 8
DTYPE = torch.float32


def vllm_views(
    name: str, *, num_layers: int = L, pad: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM-style per-layer ``(B, H, N, 2C)`` views into one int8 buffer (``pad`` bytes
    after each page, as vLLM's padded pages)."""
    elem = torch.finfo(DTYPE).bits // 8
    shape = (num_layers, B, H, N, 2 * C * elem)
    order = STRIDE_ORDERS[name]
    strides = [0] * 5
    step = 1
    for physical, dim in reversed(list(enumerate(order))):
        strides[dim] = step
        step *= shape[dim]
        if pad and physical == 2:  # after the page interior (L and B outermost here)
            step += pad
    raw = torch.zeros(step, dtype=torch.int8)
    view5 = torch.as_strided(raw, shape, tuple(strides))
    return raw, {f"layers.{i}.attn": view5[i].view(DTYPE) for i in range(num_layers)}


def describe(caches: dict[str, torch.Tensor], model: str = "m") -> tuple[KVLayout, str | None]:
    views, interior = logical_views(caches, num_kv_heads=H, head_size=C, block_size=N)
    suffix = packed_suffix(interior) if interior else ""
    return KVLayout.from_tensors(views, model_name=model + suffix, block_size=N), interior


def test_blhnc_is_block_outermost_one_region_one_descriptor_per_block() -> None:
    raw, caches = vllm_views("BLHNC")
    assert not caches["layers.1.attn"].is_contiguous()
    lay, interior = describe(caches)
    assert interior == "HNC"
    assert lay.model.name == "m" + PACKED_SUFFIX
    assert lay.order == ("B", "L", "KV", "N", "H", "C")
    assert lay.kind == "block-outermost"
    assert lay.num_regions == 1 and lay.regions[0].addr == raw.data_ptr()
    assert lay.descriptors_per_block() == 1
    assert lay.block_bytes() == L * H * N * 2 * C * 4 == caches["layers.0.attn"].stride(0) * 4


def test_lbhnc_single_buffer_is_one_region_of_layer_outermost_spans() -> None:
    raw, caches = vllm_views("LBHNC")
    lay, interior = describe(caches)
    assert interior == "HNC"
    assert lay.order == ("L", "B", "KV", "N", "H", "C")
    assert lay.one_region and lay.kind == "layer-outermost" and not lay.layer_separate
    assert lay.num_regions == 1 and lay.regions[0].length == raw.numel()
    assert lay.descriptors_per_block() == 2 * L


def test_separate_allocations_stay_layer_separate() -> None:
    caches = {f"l{i}": torch.zeros(B, H, N, 2 * C) for i in range(L)}
    lay, _ = describe(caches)
    assert lay.order[0] == "L" and lay.layer_separate and not lay.one_region
    assert lay.num_regions == L
    assert [r.addr for r in lay.regions] == [t.data_ptr() for t in caches.values()]


def test_n_major_interior_gets_its_own_suffix_and_never_pairs_with_head_major() -> None:
    _, nhc = vllm_views("BLNHC")
    _, hnc = vllm_views("BLHNC")
    a, ia = describe(nhc)
    b, ib = describe(hnc)
    assert (ia, ib) == ("NHC", "HNC")
    assert a.order == b.order and a.model.name != b.model.name
    assert a.negotiate(b).mode is TransferMode.INCOMPATIBLE


@pytest.mark.parametrize("name", ["BHLNC", "LHBNC"])
def test_layouts_that_split_a_blocks_heads_are_rejected_with_shape_and_strides(name: str) -> None:
    _, caches = vllm_views(name)
    t = caches["layers.0.attn"]
    want = f"shape (5, 2, 32, 16) and strides {t.stride()}"
    with pytest.raises(LayoutError, match=re.escape(want)):
        describe(caches)


def test_padded_pages_are_rejected() -> None:
    _, caches = vllm_views("BLHNC", pad=64)
    with pytest.raises(LayoutError, match="not dense"):
        describe(caches)


def test_wrong_head_count_is_rejected() -> None:
    _, caches = vllm_views("LBHNC")
    with pytest.raises(LayoutError, match=re.escape("shape (5, 2, 32, 16)") + ".*4 KV heads of 4"):
        logical_views(caches, num_kv_heads=4, head_size=C // 2, block_size=N)


def test_flashinfer_pages_strided_into_one_block_outermost_buffer() -> None:
    raw = torch.zeros(B, L, 2, N, H, C)
    caches = {f"l{i}": raw[:, i] for i in range(L)}  # (B, 2, N, H, C), strided
    views, interior = logical_views(caches, num_kv_heads=H, head_size=C, block_size=N)
    lay = KVLayout.from_tensors(views, model_name="m", block_size=N)
    assert interior is None
    assert lay.order == ("B", "L", "KV", "N", "H", "C") and lay.descriptors_per_block() == 1


def _copy_blocks(
    src_raw: torch.Tensor,
    src: KVLayout,
    dst_raw: torch.Tensor,
    dst: KVLayout,
    src_ids: list[int],
    dst_ids: list[int],
) -> int:
    """Move blocks the way a NIXL READ does: paired descriptor rows, bytes by address."""
    per_span = src.negotiate(dst).mode is not TransferMode.WHOLE_BLOCK
    st, dt = descriptor_table(src, "self", per_span), descriptor_table(dst, "self", per_span)
    di, si = request_indices(dst, src, "self", dst_ids, src_ids, per_span=per_span, strided=False)
    for d, s in zip(di.tolist(), si.tolist(), strict=True):
        (sa, n, _), (da, m, _) = st[s].tolist(), dt[d].tolist()
        assert n == m
        so, do = sa - src_raw.data_ptr(), da - dst_raw.data_ptr()
        dst_raw[do : do + n] = src_raw[so : so + n]
    return len(di)


@pytest.mark.parametrize(
    ("src_name", "dst_name", "mode"),
    [
        ("BLHNC", "BLHNC", TransferMode.WHOLE_BLOCK),
        ("LBHNC", "LBHNC", TransferMode.PER_SPAN),
        ("BLHNC", "LBHNC", TransferMode.PER_SPAN),
        ("LBHNC", "BLHNC", TransferMode.PER_SPAN),
    ],
)
def test_blocks_round_trip_byte_for_byte_between_vllm_layouts(
    src_name: str, dst_name: str, mode: TransferMode
) -> None:
    src_raw, src_caches = vllm_views(src_name)
    dst_raw, dst_caches = vllm_views(dst_name)
    g = torch.Generator().manual_seed(0)
    for t in src_caches.values():
        t.copy_(torch.randn(t.shape, generator=g))
    src, _ = describe(src_caches)
    dst, _ = describe(dst_caches)
    assert src.negotiate(dst).mode is mode
    moved = _copy_blocks(src_raw, src, dst_raw, dst, [1, 3, 4], [0, 2, 3])
    assert moved == 3 * (1 if mode is TransferMode.WHOLE_BLOCK else 2 * L)
    for name, t in dst_caches.items():
        assert torch.equal(t[[0, 2, 3]], src_caches[name][[1, 3, 4]])
        assert not t[[1, 4]].any(), "a block that was not asked for was written"


@pytest.mark.parametrize("name", ["LBHNC", "BLHNC"])
def test_strided_tables_name_the_same_bytes_as_dense_ones(name: str) -> None:
    _, caches = vllm_views(name)
    lay, _ = describe(caches)
    ids = [4, 0, 2]
    for per_span in (True, False) if name == "BLHNC" else (True,):
        table = strided_table(lay, "self", per_span)
        assert table.shape[0] == 1  # one region, one strided row
        per = 2 * L if per_span else 1
        dense = descriptor_table(lay, "self", per_span)[descriptor_indices(ids, per)]
        strided = expand_strided(table)[strided_indices(lay, "self", ids, per_span)]
        assert (dense == strided).all()


def test_one_region_travels_on_the_wire() -> None:
    _, caches = vllm_views("LBHNC")
    lay, _ = describe(caches)
    back = KVLayout.from_bytes(lay.to_bytes())
    assert back == lay and back.one_region


def test_layout_request_defaults_to_block_outermost_and_is_validated() -> None:
    assert required_layout(None) == "BLHNC"
    assert required_layout({"kv_cache_layout": "LBHNC"}) == "LBHNC"
    assert required_layout({"kv_cache_layout": "auto"}) is None
    with pytest.raises(ConfigError, match="kv_cache_layout 'BHLNC' is not one of"):
        VllmConnectorConfig.from_vllm("kv_consumer", "e", {"kv_cache_layout": "BHLNC"}, model="m")
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        required_layout({"kv_cache_layout": "HND"})

"""kvbridge.kernels on a CUDA device: the span kernel and the torch CUDA fallback.

Every result is compared bit for bit with the CPU path (itself checked
against a per-block reference in test_kernels.py). Marked ``gpu`` and skipped
without CUDA, except the check that the kernel source compiles (needs nvcc only).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest
import torch

from kvbridge.kernels import (
    convert_blocks,
    copy_blocks,
    gather_blocks,
    scatter_blocks,
    staging_nbytes,
)
from kvbridge.proto import ORDERS, KVLayout
from kvbridge.proto.presets import PresetShape, make_layout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
Cache = dict[str, torch.Tensor]
INT_OF = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def layout_of(order: str, dtype: str = "bfloat16", num_blocks: int = 9) -> KVLayout:
    # 32-token blocks x 2 heads x 64: 8 KiB spans, long enough for the span kernel
    shape = PresetShape("g", 4, 2, 64, dtype, share_every=2)
    return make_layout(shape, block_size=32, num_blocks=num_blocks, order=order)


def random_cache(layout: KVLayout, seed: int, device: str = "cpu") -> Cache:
    cache = layout.allocate(device)
    gen = torch.Generator().manual_seed(seed)
    for layer in layout.owning_layers("self"):
        raw = cache[layer.name].view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return cache


def to(cache: Cache, device: str) -> Cache:
    """The same cache on ``device``, KV-sharing aliases preserved."""
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in cache.items():
        if id(t) not in moved:
            moved[id(t)] = t.to(device)
        out[name] = moved[id(t)]
    return out


def assert_same(a: Cache, b: Cache, layout: KVLayout) -> None:
    for layer in layout.owning_layers("self"):
        x, y = a[layer.name].cpu(), b[layer.name].cpu()
        assert torch.equal(x.view(INT_OF[x.element_size()]), y.view(INT_OF[y.element_size()]))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_copy_blocks_on_gpu_matches_cpu(order: str, dtype: str) -> None:
    layout = layout_of(order, dtype)
    src, dst = random_cache(layout, 1), random_cache(layout, 2)
    g_src, g_dst = to(src, "cuda"), to(dst, "cuda")
    pairs = [(8, 0), (3, 4), (3, 5), (0, 8)]
    copy_blocks(src, dst, layout, pairs)
    copy_blocks(g_src, g_dst, layout, pairs)
    torch.cuda.synchronize()
    assert_same(dst, g_dst, layout)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("a", "b"), list(itertools.product(ORDERS, ORDERS)))
def test_convert_blocks_on_gpu_matches_cpu(a: str, b: str) -> None:
    la, lb = layout_of(a), layout_of(b, num_blocks=6)
    src, dst = random_cache(la, 3), random_cache(lb, 4)
    g_src, g_dst = to(src, "cuda"), to(dst, "cuda")
    pairs = [(1, 5), (7, 0), (7, 2)]
    convert_blocks(src, la, dst, lb, pairs)
    convert_blocks(g_src, la, g_dst, lb, pairs)
    torch.cuda.synchronize()
    assert_same(dst, g_dst, lb)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("staging_device", ["cuda", "cpu"])
def test_gather_and_scatter_on_gpu_match_cpu(order: str, staging_device: str) -> None:
    layout = layout_of(order)
    cache = random_cache(layout, 5)
    g_cache = to(cache, "cuda")
    ids = [6, 1, 1, 3]
    want = torch.empty(staging_nbytes(layout, 4), dtype=torch.uint8)
    gather_blocks(cache, layout, ids, want)
    pin = staging_device == "cpu"
    got = torch.empty(staging_nbytes(layout, 4), dtype=torch.uint8, device=staging_device)
    if pin:
        got = got.pin_memory()
    gather_blocks(g_cache, layout, ids, got)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    back, g_back = random_cache(layout, 6), to(random_cache(layout, 6), "cuda")
    scatter_blocks(want, back, layout, [0, 2, 4, 8])
    scatter_blocks(got, g_back, layout, [0, 2, 4, 8])
    torch.cuda.synchronize()
    assert_same(back, g_back, layout)


@pytest.mark.gpu
@needs_cuda
def test_copy_between_host_and_gpu_caches() -> None:
    layout = layout_of("block-nhd")
    host = random_cache(layout, 7)
    gpu = to(random_cache(layout, 8), "cuda")
    copy_blocks(host, gpu, layout, [(0, 1), (5, 2)])
    back = random_cache(layout, 9)
    copy_blocks(gpu, back, layout, [(1, 3), (2, 4)])
    for layer in layout.owning_layers("self"):
        got, want = back[layer.name][:, [3, 4]], host[layer.name][:, [0, 5]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("block_size", "head_size"),
    [(7, 37), (4, 65), (8, 33)],  # fp8 spans of 259, 260 and 264 bytes: 1-, 4- and 8-aligned
)
def test_span_kernel_handles_unaligned_spans(block_size: int, head_size: int) -> None:
    shape = PresetShape("odd", 2, 1, head_size, "float8_e4m3fn")
    layout = make_layout(shape, block_size=block_size, num_blocks=40, order="layer-kv-nhd")
    src, dst = random_cache(layout, 10), random_cache(layout, 11)
    g_src, g_dst = to(src, "cuda"), to(dst, "cuda")
    pairs = [(i, 39 - i) for i in range(0, 40, 3)]
    copy_blocks(src, dst, layout, pairs)
    copy_blocks(g_src, g_dst, layout, pairs)
    torch.cuda.synchronize()
    assert_same(dst, g_dst, layout)


@pytest.mark.gpu
@needs_cuda
def test_span_table_uses_one_launch_for_per_layer_allocations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvbridge.kernels import cuda_path

    calls: list[int] = []
    real = cuda_path.launch_spans

    def counting(spans: torch.Tensor, device: torch.device) -> bool:
        calls.append(spans.shape[0])
        return real(spans, device)

    layout = layout_of("layer-nhd")
    s = layout.sizes("self")
    separate: Cache = {}
    for x in layout.layers:
        if x.kv_source is None:
            t = torch.randint(0, 100, (s["B"], 2, s["N"], s["H"], s["C"]), device="cuda")
            separate[x.name] = t.to(torch.bfloat16).permute(1, 0, 2, 3, 4)
        else:
            separate[x.name] = separate[x.kv_source]
    dst = to(random_cache(layout, 12), "cuda")
    monkeypatch.setattr(cuda_path, "launch_spans", counting)
    copy_blocks(separate, dst, layout, [(0, 1), (2, 3)])
    torch.cuda.synchronize()
    for x in layout.owning_layers("self"):
        got, want = dst[x.name][:, [1, 3]], separate[x.name][:, [0, 2]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert len(calls) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_span_kernel_source_compiles_to_16_byte_global_loads(tmp_path: Path) -> None:
    """Runs without a GPU wherever nvcc is installed (cupy compiles the same source via NVRTC)."""
    source = resources.files("kvbridge.kernels").joinpath("copy_spans.cu")
    ptx = tmp_path / "copy_spans.ptx"
    with resources.as_file(source) as cu:
        subprocess.run(
            ["nvcc", "--ptx", "-arch=sm_80", "-std=c++14", str(cu), "-o", str(ptx)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    text = ptx.read_text()
    assert ".entry kvb_copy_spans" in text
    assert "ld.global.nc.v4.u32" in text

"""Bit-level helpers of the kernel tests: random caches and per-block logical references."""

from __future__ import annotations

import torch

from kvbridge.proto import KVLayout

__all__ = [
    "Cache",
    "assert_cache_equals",
    "bits",
    "random_cache",
    "reference_copy",
    "reference_staging",
    "snapshot",
]

INT_OF = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
Cache = dict[str, torch.Tensor]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_OF[t.element_size()])


def random_cache(layout: KVLayout, seed: int) -> Cache:
    """Every byte random (NaN/inf bit patterns included: the copy must not touch them)."""
    cache = layout.allocate()
    gen = torch.Generator().manual_seed(seed)
    for g in layout.groups:
        for layer in layout.owning_layers(g.name):
            t = bits(cache[layer.name])
            raw = torch.randint(0, 256, (*t.shape, t.element_size()), generator=gen)
            t.copy_(raw.to(torch.uint8).view(t.dtype).squeeze(-1))
    return cache


def snapshot(cache: Cache) -> dict[str, torch.Tensor]:
    return {k: bits(v).clone() for k, v in cache.items()}


def reference_copy(
    src: Cache, src_layout: KVLayout, dst: Cache, pairs: list[tuple[int, int]], group: str
) -> dict[str, torch.Tensor]:
    """Expected dst after the copy: one logical block assignment at a time."""
    want = snapshot(dst)
    for layer in src_layout.owning_layers(group):
        for s, d in pairs:
            want[layer.name][:, d] = bits(src[layer.name])[:, s]
    return want


def assert_cache_equals(cache: Cache, want: dict[str, torch.Tensor], layout: KVLayout) -> None:
    for layer in layout.layers:
        got = bits(cache[layer.name])
        src = layer.kv_source or layer.name
        assert torch.equal(got, want[src]), f"layer {layer.name} differs"


def reference_staging(cache: Cache, layout: KVLayout, ids: list[int], group: str) -> torch.Tensor:
    """Blocks as documented: owning layers, K then V, N/H/C in the layout's inner order."""
    perm = [("N", "H", "C").index(d) for d in layout.inner_order]
    parts = []
    for b in ids:
        for layer in layout.owning_layers(group):
            for kv in (0, 1):
                span = bits(cache[layer.name])[kv, b].permute(*perm).contiguous()
                parts.append(span.view(torch.uint8).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)

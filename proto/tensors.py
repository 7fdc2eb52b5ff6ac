"""Building and describing KV tensors for a layout (imports torch).

Every layer is handed a view of logical shape ``(2, num_blocks, block_size,
H, C)`` — K/V, block, token, head, channel — whose strides follow the
physical order, the way vLLM hands per-layer views to its attention
backends. A layer that shares another layer's KV gets the very same tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace
from typing import TypeVar

import torch

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout_core import LayoutCore
from kvbridge.proto.specs import (
    DTYPE_BYTES,
    GroupSpec,
    KVGroup,
    LayerSpec,
    ModelSpec,
    PageShape,
    Region,
    group_rank,
    parse_group,
)

__all__ = ["allocate", "bind", "from_tensors", "torch_dtype", "LOGICAL"]

L = TypeVar("L", bound=LayoutCore)

LOGICAL = ("KV", "B", "N", "H", "C")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPE_BYTES:
        raise LayoutError(f"dtype {name!r} is not one of {', '.join(DTYPE_BYTES)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise LayoutError(
            f"KV tensors of dtype {dtype} are not supported; use one of {list(DTYPE_BYTES)}"
        )
    return name


def allocate(layout: LayoutCore, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed KV tensors for ``layout``: per-layer views, one allocation per region.

    Block-outermost (and any single-region) groups are one allocation in which
    each block holds every layer's K and V (or, for ``one_region``
    layer-outermost, layers follow each other); layer-separate groups get one
    allocation per owning layer, so :func:`from_tensors` describes them again
    as layer-separate.
    """
    dtype = torch_dtype(layout.model.dtype)
    elem = layout.model.dtype_bytes
    out: dict[str, torch.Tensor] = {}
    for g in layout.groups:
        sizes = layout.sizes(g.name)
        strides = {d: s // elem for d, s in layout.strides(g.name).items()}
        shape = [sizes[d] for d in LOGICAL]
        stride = [strides[d] for d in LOGICAL]
        owners = layout.owning_layers(g.name)
        nbuf = len(layout.regions_of(g.name))
        bufs = [
            torch.zeros(layout.group_bytes(g.name) // elem // nbuf, dtype=dtype, device=device)
            for _ in range(nbuf)
        ]
        for li, layer in enumerate(owners):
            if layout.layer_separate:
                out[layer.name] = torch.as_strided(bufs[li], shape, stride, 0)
            else:
                out[layer.name] = torch.as_strided(bufs[0], shape, stride, li * strides["L"])
        for layer in layout.layers:
            if layer.group == g.name and layer.kv_source is not None:
                out[layer.name] = out[layer.kv_source]
    return {x.name: out[x.name] for x in layout.layers}


def _regions(layout: LayoutCore, kv_caches: Mapping[str, torch.Tensor]) -> list[Region]:
    regions = []
    for g in layout.groups:
        owners = layout.owning_layers(g.name)
        per = layout.group_bytes(g.name) // len(layout.regions_of(g.name))
        starts = (
            [kv_caches[x.name] for x in owners]
            if layout.layer_separate
            else [kv_caches[owners[0].name]]
        )
        for t in starts:
            regions.append(Region(t.data_ptr(), per, str(t.device)))
    _check_disjoint(regions)
    return regions


def _check_disjoint(regions: list[Region]) -> None:
    """LayoutError if two regions share bytes: a load into one would overwrite the other
    (layers that really share KV alias one tensor and own no region). Regions that are
    the same bytes exactly are one region seen by two groups: vLLM's hybrid KV cache groups
    share their pages (a block id belongs to one group at a time), and each group describes
    the pages with its own layers."""
    spans = sorted({(r.device, r.addr, r.addr + r.length) for r in regions})
    for (dev_a, a0, a1), (dev_b, b0, _) in itertools.pairwise(spans):
        if dev_a == dev_b and b0 < a1:
            raise LayoutError(
                f"KV regions overlap on {dev_a}: 0x{a0:x}..0x{a1:x} and one at 0x{b0:x}; "
                "each layer's KV must be its own memory (or alias another layer's tensor)"
            )


def bind(layout: L, kv_caches: Mapping[str, torch.Tensor]) -> L:
    """``layout`` with its regions read from ``kv_caches``, after checking they match it."""
    described = from_tensors(
        type(layout),
        kv_caches,
        model_name=layout.model.name,
        block_size=layout.block_size,
        layer_groups={x.name: x.group for x in layout.layers},
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
    )
    # with one owning layer the L dimension can sit anywhere: take the layout's word
    same_without_l = [d for d in described.order if d != "L"] == [
        d for d in layout.order if d != "L"
    ]
    if len(layout.owning_layers(KVGroup.SELF)) == 1 and same_without_l:
        described = layout.with_regions(_regions(layout, kv_caches))
    if described.one_region and layout.layer_separate and described.order == layout.order:
        # layers in one allocation may still be registered one region per layer
        described = layout.with_regions(_regions(layout, kv_caches))
    if (
        described.identity() != layout.identity()
        or described.order != layout.order
        or described.one_region != layout.one_region
    ):
        raise LayoutError(
            f"tensors do not match the layout: they are {' '.join(described.order)} "
            f"{described.identity()}, layout is {' '.join(layout.order)} {layout.identity()}"
        )
    if [g.num_blocks for g in described.groups] != [g.num_blocks for g in layout.groups]:
        raise LayoutError("tensors have other block counts than the layout")
    return described


def from_tensors(
    cls: type[L],
    kv_caches: Mapping[str, torch.Tensor],
    *,
    model_name: str,
    block_size: int,
    layer_groups: Mapping[str, str] | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> L:
    """Describe per-layer KV views of logical shape ``(2, B, N, H, C)``, as a ``cls``.

    The physical order is inferred from the views' strides and, for the
    ``L`` dimension, from the distance between consecutive layers' data
    pointers. Layers whose tensor has the same address as an earlier layer's
    become KV-sharing layers. Anything that is not dense in some supported
    order is rejected with a LayoutError saying what was found.
    """
    if not kv_caches:
        raise LayoutError("no KV tensors given")
    groups_of = dict(layer_groups or {})
    first = next(iter(kv_caches.values()))
    dtype = _dtype_name(first.dtype)
    elem = DTYPE_BYTES[dtype]
    layers: list[LayerSpec] = []
    owner_at: dict[tuple[int, KVGroup], str] = {}
    num_blocks: dict[KVGroup, int] = {}
    page_of: dict[KVGroup, tuple[int, int, int]] = {}
    order: tuple[str, ...] | None = None
    for name, t in kv_caches.items():
        group = parse_group(groups_of.get(name, KVGroup.SELF))
        if t.dim() != 5 or t.shape[0] != 2:
            raise LayoutError(
                f"layer {name!r}: expected shape (2, num_blocks, block_size, heads, head_size), "
                f"got {tuple(t.shape)}"
            )
        if t.dtype != first.dtype or t.device != first.device:
            raise LayoutError(f"layer {name!r}: dtype/device differ from other layers")
        page = (t.shape[2], t.shape[3], t.shape[4])
        if page_of.setdefault(group, page) != page:
            raise LayoutError(
                f"layer {name!r}: {_page_words(page)}, other layers of group {group!r} "
                f"{_page_words(page_of[group])}"
            )
        if num_blocks.setdefault(group, t.shape[1]) != t.shape[1]:
            raise LayoutError(
                f"layer {name!r}: {t.shape[1]} blocks, group {group!r} has {num_blocks[group]}"
            )
        key = (t.data_ptr(), group)
        if key in owner_at:
            if kv_caches[owner_at[key]].stride() != t.stride():
                raise LayoutError(f"layer {name!r} aliases {owner_at[key]!r} with other strides")
            layers.append(LayerSpec(name, group, owner_at[key]))
            continue
        owner_at[key] = name
        layers.append(LayerSpec(name, group))
        inner = _inner_order(name, t)
        if order is None:
            order = inner
        elif order != inner:
            raise LayoutError(f"layer {name!r} has order {inner}, earlier layers {order}")
    assert order is not None
    group_names = sorted({KVGroup.SELF, *num_blocks}, key=group_rank)
    if set(num_blocks) - set(group_names):
        raise LayoutError(f"unknown groups {sorted(set(num_blocks) - set(group_names))}")
    per_group = {g: sum(1 for x in layers if x.group == g) for g in group_names}
    if len(set(per_group.values())) != 1:
        raise LayoutError(f"groups have different layer counts {per_group}")
    own = page_of[KVGroup.SELF]
    if own[0] != block_size:
        name = next(x.name for x in layers if x.group == KVGroup.SELF)
        raise LayoutError(
            f"layer {name!r}: expected shape (2, num_blocks, {block_size}, heads, head_size) "
            f"(group 'self', the layout's block size), got {tuple(kv_caches[name].shape)}"
        )
    # Where does L go? Uniform layer step inside one allocation -> by stride; else outermost.
    full_order = _place_layer_dim(kv_caches, layers, order, elem)
    model = ModelSpec(
        name=model_name,
        dtype=dtype,
        num_layers=per_group[KVGroup.SELF],
        num_kv_heads=own[1] * tp_size,
        head_size=own[2],
    )
    layout = cls(
        model=model,
        block_size=block_size,
        groups=tuple(
            GroupSpec(g, num_blocks[g], _page(page_of[g], own, tp_size)) for g in group_names
        ),
        layers=tuple(layers),
        order=full_order,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    if full_order[0] == "L" and _one_allocation(layout, kv_caches):
        layout = replace(layout, one_region=True)
    _check_dense(layout, kv_caches)
    return layout.with_regions(_regions(layout, kv_caches))


def _page_words(page: tuple[int, int, int]) -> str:
    return f"{page[0]}-token blocks of {page[1]} KV heads x {page[2]}"


def _page(page: tuple[int, int, int], own: tuple[int, int, int], tp_size: int) -> PageShape | None:
    """A group's :class:`PageShape` from its tensors' ``(N, H, C)`` (H: this rank's heads),
    None where it is ``self``'s (the layout's own)."""
    return None if page == own else PageShape(page[0], page[1] * tp_size, page[2])


def _one_allocation(layout: LayoutCore, kv_caches: Mapping[str, torch.Tensor]) -> bool:
    """Whether every group's owning layers share one storage at the dense layer step
    (then a layer-outermost group is one region, not one per layer)."""
    for g in layout.groups:
        owners = [kv_caches[x.name] for x in layout.owning_layers(g.name)]
        step = layout.strides(g.name)["L"]
        storage = owners[0].untyped_storage().data_ptr()
        base = owners[0].data_ptr()
        if len(owners) < 2 or any(
            t.untyped_storage().data_ptr() != storage or t.data_ptr() != base + i * step
            for i, t in enumerate(owners)
        ):
            return False
    return True


def _inner_order(name: str, t: torch.Tensor) -> tuple[str, ...]:
    """The five per-layer dims by stride, outermost first; size-1 dims go canonically."""
    stride = dict(zip(LOGICAL, t.stride(), strict=True))
    size = dict(zip(LOGICAL, t.shape, strict=True))
    canonical = {d: i for i, d in enumerate(("B", "KV", "N", "H", "C"))}
    dims = sorted(LOGICAL, key=lambda d: (-stride[d] if size[d] > 1 else 0, canonical[d]))
    movable = [d for d in dims if size[d] > 1]
    fixed = sorted((d for d in dims if size[d] == 1), key=canonical.__getitem__)
    # size-1 dims have no meaningful stride: put them where the canonical order would
    result = list(movable)
    for d in fixed:
        pos = sum(1 for x in result if canonical[x] < canonical[d])
        result.insert(pos, d)
    if set(result[:2]) != {"B", "KV"}:
        raise LayoutError(
            f"layer {name!r}: strides {t.stride()} put {' '.join(result)} in order; "
            "kvbridge needs K/V and block dims outside the token/head/channel dims"
        )
    return tuple(result)


def _place_layer_dim(
    kv_caches: Mapping[str, torch.Tensor],
    layers: list[LayerSpec],
    order: tuple[str, ...],
    elem: int,
) -> tuple[str, ...]:
    owners = [x for x in layers if x.kv_source is None and x.group == KVGroup.SELF]
    ptrs = [kv_caches[x.name].data_ptr() for x in owners]
    steps = {b - a for a, b in itertools.pairwise(ptrs)}
    t = kv_caches[owners[0].name]
    stride = dict(zip(LOGICAL, (s * elem for s in t.stride()), strict=True))
    if len(steps) == 1 and (step := steps.pop()) > 0:
        for i, d in enumerate(order[:2]):
            if step > stride[d]:
                return (*order[:i], "L", *order[i:]) if i else ("L", *order)
        return (*order[:2], "L", *order[2:])
    return ("L", *order)


def _check_dense(layout: LayoutCore, kv_caches: Mapping[str, torch.Tensor]) -> None:
    elem = layout.model.dtype_bytes
    for g in layout.groups:
        st = layout.strides(g.name)
        want = tuple(st[d] // elem for d in LOGICAL)
        owners = layout.owning_layers(g.name)
        base = kv_caches[owners[0].name].data_ptr()
        for li, x in enumerate(owners):
            t = kv_caches[x.name]
            got = t.stride()
            if any(
                a != b
                for a, b, d in zip(got, want, LOGICAL, strict=True)
                if t.shape[LOGICAL.index(d)] > 1
            ):
                raise LayoutError(
                    f"layer {x.name!r}: strides {got} are not dense for order "
                    f"{' '.join(layout.order)} (expected {want}); padded layouts are not supported"
                )
            if not layout.layer_separate and t.data_ptr() != base + li * st["L"]:
                raise LayoutError(
                    f"layer {x.name!r} is not at layer offset {li} of one allocation in order "
                    f"{' '.join(layout.order)}"
                )

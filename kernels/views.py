"""Strided views that let one torch (or CUDA) op move many blocks at once.

Every kernel works on *group views*: 6-D tensors of logical shape
``(l, KV, B, N, H, C)`` over the real memory (``l`` consecutive owning
layers; K before V), built from the per-layer tensors that
:meth:`KVLayout.allocate` hands out. When all owning layers of a group sit in
one storage at a uniform layer step (everything ``allocate`` builds, in every
order) the group is a single view; otherwise (layer-separate tensors from
separate allocations) there is one view per owning layer.

A copy between two such views indexes the ``B`` dimension. :func:`coalesce`
moves it first, drops size-1 dimensions and merges neighbours that are
contiguous in *both* views, so that e.g. two block-outermost caches become ``(B, block_elems)``
matrices and one ``index_select``/``index_copy_`` moves whole blocks.
:func:`widen` then reinterprets the innermost contiguous run as the widest
integer type the alignment allows (bit-exact: bytes are never converted).

Staging buffers (see :func:`staging_view`) hold block ``i`` of a call at
byte ``i * layout.block_bytes(group)``: owning layers in layout order, K
before V, then ``N``/``H``/``C`` in the layout's inner order, i.e. the
block's spans concatenated in :meth:`KVLayout.block_spans` order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.tensors import torch_dtype

__all__ = [
    "B_DIM",
    "group_views",
    "paired_views",
    "staging_view",
    "coalesce",
    "widen",
    "same_size_int",
]

#: position of the block dimension in a group view ``(l, KV, B, N, H, C)``
B_DIM = 2
_INNER = ("N", "H", "C")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_size_int(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as the integer dtype of the same width (works for any strides)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _check_tensor(name: str, t: object, want: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"layer {name!r}: expected a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise LayoutError(
            f"layer {name!r}: shape {tuple(t.shape)} does not match the layout's "
            f"(2, num_blocks, block_size, heads, head_size) = {want}"
        )
    if t.dtype != dtype:
        raise LayoutError(f"layer {name!r}: dtype {t.dtype} but the layout says {dtype}")
    return t


def group_views(
    cache: Mapping[str, torch.Tensor], layout: KVLayout, group: KVGroup
) -> list[torch.Tensor]:
    """6-D views ``(l, KV, B, N, H, C)`` covering the owning layers of ``group`` in order.

    One view when the owning layers share a storage at a uniform step,
    otherwise one per layer. KV-sharing layers are never looked at.
    """
    owners = layout.owning_layers(group)
    s = layout.sizes(group)
    want = (2, s["B"], s["N"], s["H"], s["C"])
    dtype = torch_dtype(layout.model.dtype)
    tensors = []
    for layer in owners:
        if layer.name not in cache:
            raise LayoutError(f"KV cache has no tensor for owning layer {layer.name!r}")
        tensors.append(_check_tensor(layer.name, cache[layer.name], want, dtype))
    first = tensors[0]
    device = first.device
    for layer, t in zip(owners, tensors, strict=True):
        if t.device != device:
            raise LayoutError(f"layer {layer.name!r} is on {t.device}, layer 0 on {device}")
    if len(tensors) == 1:
        return [first.unsqueeze(0)]
    elem = first.element_size()
    step = tensors[1].data_ptr() - first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    uniform = step % elem == 0 and all(
        t.stride() == first.stride()
        and t.untyped_storage().data_ptr() == storage
        and t.data_ptr() == first.data_ptr() + i * step
        for i, t in enumerate(tensors)
    )
    if uniform:
        shape = (len(tensors), *first.shape)
        stride = (step // elem, *first.stride())
        try:
            return [first.as_strided(shape, stride, first.storage_offset())]
        except RuntimeError:  # e.g. a negative step torch cannot express
            pass
    return [t.unsqueeze(0) for t in tensors]


def paired_views(
    a: list[torch.Tensor], b: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair two sides' group views layer-for-layer (one pair if both are single views)."""
    if len(a) == 1 and len(b) == 1:
        return [(a[0], b[0])]

    def per_layer(views: list[torch.Tensor]) -> list[torch.Tensor]:
        return [v if v.shape[0] == 1 else v[i : i + 1] for v in views for i in range(v.shape[0])]

    pa, pb = per_layer(a), per_layer(b)
    assert len(pa) == len(pb), "both sides come from layouts with the same owning layers"
    return list(zip(pa, pb, strict=True))


def staging_view(
    staging: torch.Tensor, layout: KVLayout, group: KVGroup, count: int, what: str
) -> torch.Tensor:
    """A 6-D view ``(L, KV, count, N, H, C)`` over a contiguous staging buffer.

    ``staging`` is 1-D, contiguous, of dtype ``uint8`` or the layout's dtype,
    and holds at least ``count * layout.block_bytes(group)`` bytes; block
    ``i`` of the call occupies bytes ``[i * block_bytes, (i + 1) * block_bytes)``
    (see the module docstring for the order inside a block).
    """
    if not isinstance(staging, torch.Tensor):
        raise LayoutError(f"{what} must be a torch.Tensor, got {type(staging).__name__}")
    dtype = torch_dtype(layout.model.dtype)
    if staging.dim() != 1 or not staging.is_contiguous():
        raise LayoutError(f"{what} must be a contiguous 1-D tensor, got shape {staging.shape}")
    if staging.dtype not in (torch.uint8, dtype):
        raise LayoutError(f"{what} has dtype {staging.dtype}; use torch.uint8 or {dtype}")
    need = count * layout.block_bytes(group)
    have = staging.numel() * staging.element_size()
    if have < need:
        raise LayoutError(
            f"{what} holds {have} bytes but {count} block(s) of group {group!r} need {need}"
        )
    flat = staging.view(torch.uint8)[:need]
    if need and flat.data_ptr() % dtype.itemsize:
        raise LayoutError(f"{what} is not aligned to {dtype.itemsize} bytes")
    typed = flat.view(dtype) if need else torch.empty(0, dtype=dtype, device=staging.device)
    s = layout.sizes(group)
    sizes = {**s, "n": count}
    order = ("n", "L", "KV", *layout.inner_order)
    strides: dict[str, int] = {}
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= sizes[d]
    logical = ("L", "KV", "n", *_INNER)
    return typed.as_strided([sizes[d] for d in logical], [strides[d] for d in logical])


def coalesce(views: Sequence[torch.Tensor], dim: int = B_DIM, lead: int = 0) -> list[torch.Tensor]:
    """Views with the indexed ``dim`` first and the fewest other dims.

    The views have the same shape except along ``dim``. Other dimensions of
    size 1 are dropped; the rest follow ``views[lead]``'s strides (outermost
    first) and neighbours that are contiguous in every view are merged.
    ``dim`` is never merged (it is the one being indexed) and goes first:
    torch's CPU ``index_select``/``index_copy_`` are fast along dim 0 of a
    strided view, and a staging buffer is contiguous with its block dim first.
    """
    first = views[lead]
    rest = [d for d in range(first.dim()) if d != dim and first.shape[d] != 1]
    rest.sort(key=lambda d: (-first.stride()[d], d))
    groups: list[list[int]] = [[dim]]
    for d in rest:
        prev = groups[-1][-1]
        if len(groups) > 1 and all(v.stride(prev) == v.stride(d) * v.shape[d] for v in views):
            groups[-1].append(d)
        else:
            groups.append([d])
    out = []
    for v in views:
        shape, stride = [], []
        for g in groups:
            shape.append(math.prod(v.shape[d] for d in g))
            stride.append(v.stride(g[-1]))
        out.append(v.as_strided(shape, stride, v.storage_offset()))
    return out


def widen(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Reinterpret all views as the widest int type (<= 8 bytes) their last dim allows.

    Applies only when the last dim has stride 1 in every view; otherwise the
    views come back as same-width integers. Never converts values.
    """
    ints = [same_size_int(v) for v in views]
    if any(v.dim() == 0 or v.stride(-1) != 1 for v in ints):
        return ints
    for width in (8, 4, 2):
        if width <= ints[0].element_size():
            break
        try:
            return [v.view(_INT_OF_SIZE[width]) for v in ints]
        except RuntimeError:  # size, stride or offset not divisible: try narrower
            continue
    return ints

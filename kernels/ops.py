"""The four block operations, checked up front and dispatched on device.

Who calls them: the connector (loading and saving blocks, converting a
peer's blocks after a ``REARRANGE`` negotiation), the offload staging code
(gather to / scatter from pinned host buffers) and the reference engine. All
run in the process that owns the caches; nothing here crosses a process.

Every argument is checked (layouts, group, tensor shapes/dtypes, block ids,
mapping shape, staging size) before the first byte moves, so a rejected call
leaves the destination untouched. Then:

- both sides on one CUDA device: one launch of the span kernel
  (:mod:`kvbridge.kernels.cuda_path`) when the runs are contiguous and long
  enough, else torch's CUDA index ops;
- on CPU, source and destination apart: one call of the compiled span copy for every
  block of every view pair (:mod:`kvbridge.kernels.cpu_spans`), where it is built, with
  its tables kept between calls for the same tensors (:mod:`kvbridge.kernels.cpu_plan`); else
  (:func:`~kvbridge.kernels.torch_path.copy_pairs`) one index op per view pair when one
  side's ids are a run (gather, scatter), else one strided copy per block slice split
  between torch's threads (one pass, no temporary);
- otherwise (two devices, a copy within one cache that may overlap): torch index ops
  (:mod:`kvbridge.kernels.torch_path`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from kvbridge.kernels import cpu_plan, cpu_spans
from kvbridge.kernels.mapping import IdsLike, MappingLike, as_ids, as_mapping, check_ids
from kvbridge.kernels.torch_path import copy_pairs, copy_rows, gather_rows, scatter_rows
from kvbridge.kernels.views import coalesce, group_views, paired_views, staging_view, widen
from kvbridge.proto.errors import IncompatibleLayoutError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.negotiate import Negotiation, negotiate

__all__ = ["copy_blocks", "convert_blocks", "gather_blocks", "scatter_blocks", "staging_nbytes"]

Cache = Mapping[str, torch.Tensor]


def staging_nbytes(layout: KVLayout, count: int, group: KVGroup = KVGroup.SELF) -> int:
    """Bytes a staging buffer needs for ``count`` blocks of ``group``."""
    return count * layout.block_bytes(group)


def copy_blocks(
    src: Cache, dst: Cache, layout: KVLayout, mapping: MappingLike, group: KVGroup = KVGroup.SELF
) -> None:
    """Copy whole blocks ``src[s] -> dst[d]`` for each ``(s, d)`` in ``mapping``.

    ``src`` and ``dst`` are ``{layer name: tensor}`` caches of ``layout`` (as
    :meth:`KVLayout.allocate` builds them), on the same or different devices;
    they may be the same cache, in which case every source block is read
    before any destination block is written. Only owning layers are copied.
    """
    s_ids, d_ids = as_mapping(mapping)
    check_ids(layout, group, s_ids, distinct=False, side="mapping source")
    check_ids(layout, group, d_ids, distinct=True, side="mapping destination")

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return paired_views(group_views(src, layout, group), group_views(dst, layout, group))

    sides = (cpu_plan.cache_facts(src, layout, group), cpu_plan.cache_facts(dst, layout, group))
    if s_ids.numel() and cpu_plan.run_cached(
        "copy", (layout,), group, sides, pairs, s_ids, d_ids, lead=1
    ):
        return
    _move(pairs(), s_ids, d_ids, "copy")


def convert_blocks(
    src: Cache,
    src_layout: KVLayout,
    dst: Cache,
    dst_layout: KVLayout,
    mapping: MappingLike,
    group: KVGroup = KVGroup.SELF,
) -> None:
    """Copy blocks between caches of two orders of the same model (any pair of orders).

    Raises :class:`IncompatibleLayoutError` (naming the field) when the two
    layouts differ in identity. K and V stay apart; KV-sharing layers are
    skipped, owning layers copied once each.
    """
    negotiation = _negotiated(src_layout, dst_layout)
    if not negotiation.ok:
        raise IncompatibleLayoutError(negotiation.reason)
    s_ids, d_ids = as_mapping(mapping)
    check_ids(src_layout, group, s_ids, distinct=False, side="mapping source")
    check_ids(dst_layout, group, d_ids, distinct=True, side="mapping destination")

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return paired_views(
            group_views(src, src_layout, group), group_views(dst, dst_layout, group)
        )

    sides = (
        cpu_plan.cache_facts(src, src_layout, group),
        cpu_plan.cache_facts(dst, dst_layout, group),
    )
    layouts = (src_layout, dst_layout)
    if s_ids.numel() and cpu_plan.run_cached(
        "copy", layouts, group, sides, pairs, s_ids, d_ids, lead=1
    ):
        return
    _move(pairs(), s_ids, d_ids, "copy")


def gather_blocks(
    cache: Cache,
    layout: KVLayout,
    block_ids: IdsLike,
    staging: torch.Tensor,
    group: KVGroup = KVGroup.SELF,
) -> None:
    """Pack blocks ``block_ids`` of ``cache`` into ``staging``, block ``i`` at ``i * block_bytes``.

    ``staging`` is a contiguous 1-D ``uint8`` tensor (or of the layout's dtype)
    of at least :func:`staging_nbytes` bytes, on any device. Inside a block:
    owning layers in layout order, K before V, then N/H/C in the layout's
    inner order, i.e. the block's :meth:`KVLayout.block_spans` concatenated;
    for a block-outermost layout exactly the block's bytes in memory.
    """
    ids = as_ids(block_ids)
    check_ids(layout, group, ids, distinct=False, side="block_ids")
    n = ids.numel()

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        views = group_views(cache, layout, group)
        return paired_views(views, [staging_view(staging, layout, group, n, "staging")])

    sides = (cpu_plan.cache_facts(cache, layout, group), _staging_facts(staging, n))
    if n and cpu_plan.run_cached("gather", (layout,), group, sides, pairs, ids, _arange(n), 1):
        return
    _move(pairs(), ids, _arange(n), "gather")


def scatter_blocks(
    staging: torch.Tensor,
    cache: Cache,
    layout: KVLayout,
    block_ids: IdsLike,
    group: KVGroup = KVGroup.SELF,
) -> None:
    """Unpack ``staging`` (as written by :func:`gather_blocks`) into blocks ``block_ids``."""
    ids = as_ids(block_ids)
    check_ids(layout, group, ids, distinct=True, side="block_ids")
    n = ids.numel()

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        views = group_views(cache, layout, group)
        return paired_views([staging_view(staging, layout, group, n, "staging")], views)

    sides = (_staging_facts(staging, n), cpu_plan.cache_facts(cache, layout, group))
    if n and cpu_plan.run_cached("scatter", (layout,), group, sides, pairs, _arange(n), ids, 0):
        return
    _move(pairs(), _arange(n), ids, "scatter")


def _staging_facts(staging: object, count: int) -> tuple[object, ...] | None:
    facts = cpu_plan.tensor_facts(staging)
    return None if facts is None else (*facts, count)


@functools.lru_cache(maxsize=16)
def _arange(n: int) -> torch.Tensor:
    """``0..n-1``, the staging side's ids (read only)."""
    return torch.arange(n)


_NEGOTIATED: dict[tuple[int, int], tuple[KVLayout, KVLayout, Negotiation]] = {}


def _negotiated(src: KVLayout, dst: KVLayout) -> Negotiation:
    """:func:`negotiate` of two (frozen) layouts, kept for the next call with the same two
    objects (by identity: hashing a layout costs more than it saves; held, so their ids
    stay theirs)."""
    kept = _NEGOTIATED.get((id(src), id(dst)))
    if kept is not None and kept[0] is src and kept[1] is dst:
        return kept[2]
    result = negotiate(src, dst)
    if len(_NEGOTIATED) >= 64:
        _NEGOTIATED.clear()
    _NEGOTIATED[(id(src), id(dst))] = (src, dst, result)
    return result


def _may_overlap(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], s: torch.Tensor, d: torch.Tensor
) -> bool:
    shared = any(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for a, b in pairs)
    return shared and bool(torch.isin(s, d).any())


def _move(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    kind: str,
) -> None:
    """Move rows ``src_ids -> dst_ids`` along the block dim of every view pair."""
    if src_ids.numel() == 0:
        return
    overlap = kind == "copy" and _may_overlap(pairs, src_ids, dst_ids)
    lead = 0 if kind == "scatter" else 1  # follow the contiguous staging, else the writes
    on_cpu = all(a.device.type == "cpu" and b.device.type == "cpu" for a, b in pairs)
    if on_cpu and not overlap and cpu_spans.copy_pairs(pairs, src_ids, dst_ids, lead):
        return
    prepared = []
    for a, b in pairs:
        wa, wb = widen(coalesce([a, b], lead=lead))
        prepared.append((wa, wb, 0))
    a0, b0 = prepared[0][0], prepared[0][1]
    if a0.is_cuda and b0.device == a0.device and not overlap:
        from kvbridge.kernels import cuda_path

        if all(cuda_path.spans_apply(a, b, dim) for a, b, dim in prepared):
            spans = torch.cat(
                [cuda_path.build_spans(a, b, dim, src_ids, dst_ids) for a, b, dim in prepared]
            )
            if cuda_path.launch_spans(spans, a0.device):
                return
    if on_cpu and not overlap:  # gather and scatter pass the staging side's ids as 0..n-1
        copy_pairs([(a, b) for a, b, _ in prepared], src_ids, dst_ids)
        return
    for a, b, dim in prepared:
        if kind == "gather":
            gather_rows(a, b, dim, src_ids)
        elif kind == "scatter":
            scatter_rows(a, b, dim, dst_ids)
        else:
            copy_rows(a, b, dim, src_ids, dst_ids, chunked=not overlap)

"""Descriptor tables for NIXL: where each block (or each (layer, K/V) span of it) lives.

Pure numpy over a bound :class:`~kvbridge.proto.layout.KVLayout`; no NIXL
import, so the byte math is testable on its own. Two encodings of the same
descriptors:

- **dense** (:func:`descriptor_table`): Nx3 rows ``(address, length, device
  id)`` in the canonical order of :meth:`KVLayout.block_spans`: block-major,
  then owning layer, then K before V. Row of (block ``b``, span ``s``) is
  ``b * per_block + s`` (:func:`descriptor_indices`).
- **strided** (:func:`strided_table`): NIXL's compressed Nx5 rows
  ``(address, length, device id, stride, count)``, each standing for
  ``count`` descriptors ``stride`` bytes apart. Every layout is a dense
  array of spans in its own outer order (``order[:3]``, a permutation of
  ``B L KV``), so the table is one contiguous row per region (the whole
  pool, or each owning layer of a layer-separate pool) and its descriptors
  are numbered in *physical* order: for ``layer-nhd`` the descriptor of
  (block ``b``, owning layer ``l``, K/V ``kv``) is ``l * 2 * num_blocks +
  2 * b + kv`` (:func:`strided_indices`, with *that side's* order and
  ``num_blocks``).

Physical numbering keeps a block's K and V (and, for sequential ids, whole
runs of blocks) adjacent in the list as well as in memory, which is what
NIXL needs to merge them. Both peers enumerate a block's spans in the same
canonical order, which is what makes index arrays built from block ids pair
up; :func:`request_indices` builds both arrays of one request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import KVGroup, KVLayout

__all__ = [
    "device_id",
    "mem_type",
    "descriptor_table",
    "descriptor_indices",
    "strided_table",
    "strided_indices",
    "request_indices",
    "descriptors_per_block",
    "slice_table",
    "slice_indices",
]


def device_id(device: str) -> int:
    """``cuda:3`` → 3; host memory is device 0 for NIXL."""
    _, _, index = device.partition(":")
    return int(index) if device.startswith("cuda") and index else 0


def mem_type(device: str) -> str:
    """NIXL memory type of a torch device string."""
    return "VRAM" if device.startswith("cuda") else "DRAM"


def descriptors_per_block(layout: KVLayout, group: KVGroup, per_span: bool) -> int:
    """1 whole-block descriptor, or one per (owning layer, K/V) span when ``per_span``."""
    return 2 * len(layout.owning_layers(group)) if per_span else 1


def _span_starts(
    layout: KVLayout, group: KVGroup, per_span: bool
) -> tuple[npt.NDArray[np.uint64], int, int, int, int]:
    """Start of block 0's spans (span order), span length, block stride, block count, device."""
    if not layout.regions:
        raise LayoutError(
            "layout carries no registered regions; use the bound layout "
            "(LocalMemory.layout / KVLayout.bind) so addresses are known"
        )
    regions = [layout.regions[i] for i in layout.regions_of(group)]
    st = layout.strides(group)
    nblocks = layout.group(group).num_blocks
    dev = device_id(regions[0].device)
    per_block = descriptors_per_block(layout, group, per_span)
    if nblocks * per_block >= 2**31:
        raise LayoutError(
            f"{nblocks} blocks of group {group!r} need more than 2**31 descriptors; NIXL "
            "indexes descriptors with int32: use fewer, larger blocks"
        )
    if not per_span:
        if not layout.block_outermost:
            raise LayoutError(
                f"one descriptor per block needs a block-outermost layout, got "
                f"{' '.join(layout.order)}"
            )
        return np.array([regions[0].addr], dtype=np.uint64), st["B"], st["B"], nblocks, dev
    nlayers = len(layout.owning_layers(group))
    if layout.layer_separate:
        base = np.array([r.addr for r in regions], dtype=np.uint64)
    else:
        base = np.uint64(regions[0].addr) + np.arange(nlayers, dtype=np.uint64) * np.uint64(st["L"])
    kv = np.array([0, st["KV"]], dtype=np.uint64)
    starts = (base[:, None] + kv[None, :]).reshape(-1)
    return starts, layout.group_span_bytes(group), st["B"], nblocks, dev


def descriptor_table(layout: KVLayout, group: KVGroup, per_span: bool) -> npt.NDArray[np.uint64]:
    """Nx3 rows for every block of ``group``: one per block, or one per span if ``per_span``.

    Block-major: row ``b * per_block + s`` is span ``s`` of block ``b``.
    """
    starts, length, stride, nblocks, dev = _span_starts(layout, group, per_span)
    blocks = np.arange(nblocks, dtype=np.uint64) * np.uint64(stride)
    addr = (blocks[:, None] + starts[None, :]).reshape(-1)
    table = np.empty((addr.shape[0], 3), dtype=np.uint64)
    table[:, 0] = addr
    table[:, 1] = length
    table[:, 2] = dev
    return table


def strided_table(layout: KVLayout, group: KVGroup, per_span: bool) -> npt.NDArray[np.uint64]:
    """Nx5 NIXL strided rows for every block of ``group``, in physical (address) order.

    Every layout is a dense array of spans in its own outer order
    (``layout.order[:3]``, a permutation of ``B L KV``), so the descriptors
    form one contiguous run per region: one row for a single-allocation
    layout, one per owning layer for a layer-separate one. Rows are
    ``(region start, length, device id, length, count)``; the descriptor
    of (block ``b``, span ``s``) is :func:`strided_indices`. ``WHOLE_BLOCK``
    is one row of ``num_blocks`` whole blocks.
    """
    starts, length, _, nblocks, dev = _span_starts(layout, group, per_span)
    if not per_span:
        rows, count = starts, nblocks
    elif layout.layer_separate:  # one region per owning layer; blocks and K/V inside it
        rows, count = starts[0::2], 2 * nblocks
    else:  # one region holding every span
        rows, count = starts[:1], starts.shape[0] * nblocks
    table = np.empty((rows.shape[0], 5), dtype=np.uint64)
    table[:, 0] = rows
    table[:, 1] = length
    table[:, 2] = dev
    table[:, 3] = length
    table[:, 4] = count
    return table


def slice_table(layout: KVLayout, group: KVGroup, part: int, parts: int) -> npt.NDArray[np.uint64]:
    """Nx3 rows, one per (block, owning layer) page: slice ``part`` of ``parts`` equal spans
    of each page (``HEAD_SLICE``; :func:`kvbridge.proto.negotiate.head_slices`).

    Block-major: row ``b * layers + l`` is owning layer ``l`` of block ``b``. A page is
    both K/V halves of one (layer, block), one dense span when ``KV`` is third in the
    order; a peer's table pairs row for row with any page order of the other side.
    """
    if layout.order[2] != "KV":
        raise LayoutError(f"a page of order {' '.join(layout.order)} is not one span")
    if not 0 <= part < parts:
        raise LayoutError(f"slice {part} is outside {parts} slices")
    page = 2 * layout.group_span_bytes(group)  # the group's own page shape
    if page % parts:
        raise LayoutError(f"a page of {page} bytes does not split into {parts} slices")
    starts, _, stride, nblocks, dev = _span_starts(layout, group, True)
    length = page // parts
    pages = starts[0::2] + np.uint64(part * length)
    blocks = np.arange(nblocks, dtype=np.uint64) * np.uint64(stride)
    addr = (blocks[:, None] + pages[None, :]).reshape(-1)
    table = np.empty((addr.shape[0], 3), dtype=np.uint64)
    table[:, 0] = addr
    table[:, 1] = length
    table[:, 2] = dev
    return table


def slice_indices(
    layout: KVLayout, group: KVGroup, local_ids: Sequence[int], remote_ids: Sequence[int]
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Rows of both sides' :func:`slice_table` for one request, paired page for page and
    sorted by local row (both sides have the same owning layers)."""
    per = len(layout.owning_layers(group))
    li = descriptor_indices(local_ids, per)
    ri = descriptor_indices(remote_ids, per)
    order = np.argsort(li, kind="stable")
    return li[order], ri[order]


def _ids(block_ids: Sequence[int]) -> npt.NDArray[np.int64]:
    return np.asarray(block_ids, dtype=np.int64).reshape(-1)


def descriptor_indices(block_ids: Sequence[int], per_block: int) -> npt.NDArray[np.int32]:
    """Rows of :func:`descriptor_table` for ``block_ids``: block-major, in the ids' order."""
    ids = _ids(block_ids)
    if per_block == 1:
        return ids.astype(np.int32)
    rows = ids[:, None] * per_block + np.arange(per_block, dtype=np.int64)[None, :]
    return rows.reshape(-1).astype(np.int32)


def strided_indices(
    layout: KVLayout, group: KVGroup, block_ids: Sequence[int], per_span: bool
) -> npt.NDArray[np.int32]:
    """Descriptors of :func:`strided_table` for ``block_ids``: block-major, in the ids' order.

    ``layout`` is the side whose table this indexes: its own ``num_blocks``
    and physical order (local and remote pools may differ in both). The
    request lists block ``ids[0]``'s spans in canonical order, then
    ``ids[1]``'s, exactly like :func:`descriptor_indices`, so local and
    remote arrays pair span for span whatever each side's order.
    """
    ids = _ids(block_ids)
    if not per_span:
        return ids.astype(np.int32)
    sizes = layout.sizes(group)
    outer = [d for d in layout.order if d in ("B", "L", "KV")]
    step = {outer[2]: 1, outer[1]: sizes[outer[2]], outer[0]: sizes[outer[1]] * sizes[outer[2]]}
    span = np.arange(2 * sizes["L"], dtype=np.int64)
    per_span_part = (span // 2) * step["L"] + (span % 2) * step["KV"]
    rows = ids[:, None] * step["B"] + per_span_part[None, :]
    return rows.reshape(-1).astype(np.int32)


def request_indices(
    local: KVLayout,
    remote: KVLayout,
    group: KVGroup,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    *,
    per_span: bool,
    strided: bool,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Local and remote descriptor indices of one request, paired position by position.

    ``strided`` picks :func:`strided_indices` (tables from
    :func:`strided_table`), else :func:`descriptor_indices`. Pairs are sorted
    by local index: NIXL merges a run of descriptors only when they are
    adjacent in the prepped list *and* contiguous in memory on both sides,
    so listing them in local order lets sequential blocks coalesce (e.g.
    every block of one layer of a layer-separate pool into one descriptor).
    """
    if strided:
        li = strided_indices(local, group, local_ids, per_span)
        ri = strided_indices(remote, group, remote_ids, per_span)
    else:
        per = 2 * len(local.owning_layers(group)) if per_span else 1
        li = descriptor_indices(local_ids, per)
        ri = descriptor_indices(remote_ids, per)
    order = np.argsort(li, kind="stable")
    return li[order], ri[order]

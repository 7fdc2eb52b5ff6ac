"""Descriptor tables for NIXL: where each block (or each (layer, K/V) span of it) lives.

Pure numpy over a bound :class:`~kvbridge.proto.layout.KVLayout`; no NIXL
import, so the byte math is testable on its own. Rows are
``(address, length, device id)`` in the canonical order of
:meth:`KVLayout.block_spans`: block-major, then owning layer, then K before
V. Both peers enumerate the same way, which is what makes index arrays
built from block ids pair up.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.proto.errors import LayoutError
from kvbridge.proto.layout import KVLayout

__all__ = ["device_id", "mem_type", "descriptor_table", "descriptor_indices"]


def device_id(device: str) -> int:
    """``cuda:3`` → 3; host memory is device 0 for NIXL."""
    _, _, index = device.partition(":")
    return int(index) if device.startswith("cuda") and index else 0


def mem_type(device: str) -> str:
    """NIXL memory type of a torch device string."""
    return "VRAM" if device.startswith("cuda") else "DRAM"


def descriptor_table(layout: KVLayout, group: str, per_span: bool) -> npt.NDArray[np.uint64]:
    """Nx3 rows for every block of ``group``: one per block, or one per span if ``per_span``."""
    if not layout.regions:
        raise LayoutError(
            "layout carries no registered regions; use the bound layout "
            "(LocalMemory.layout / KVLayout.bind) so addresses are known"
        )
    regions = [layout.regions[i] for i in layout.regions_of(group)]
    st = layout.strides(group)
    nblocks = layout.group(group).num_blocks
    dev = device_id(regions[0].device)
    blocks = np.arange(nblocks, dtype=np.uint64) * np.uint64(st["B"])
    if not per_span:
        if not layout.block_outermost:
            raise LayoutError(
                f"one descriptor per block needs a block-outermost layout, got "
                f"{' '.join(layout.order)}"
            )
        addr = np.uint64(regions[0].addr) + blocks
        length = st["B"]
    else:
        nlayers = len(layout.owning_layers(group))
        if layout.layer_separate:
            base = np.array([r.addr for r in regions], dtype=np.uint64)
        else:
            base = np.uint64(regions[0].addr) + np.arange(nlayers, dtype=np.uint64) * np.uint64(
                st["L"]
            )
        kv = np.array([0, st["KV"]], dtype=np.uint64)
        addr = (blocks[:, None, None] + base[None, :, None] + kv[None, None, :]).reshape(-1)
        length = layout.span_bytes
    table = np.empty((addr.shape[0], 3), dtype=np.uint64)
    table[:, 0] = addr
    table[:, 1] = length
    table[:, 2] = dev
    return table


def descriptor_indices(block_ids: Sequence[int], per_block: int) -> npt.NDArray[np.int32]:
    """Rows of :func:`descriptor_table` for ``block_ids``, in the ids' order."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if per_block == 1:
        return ids.astype(np.int32)
    rows = ids[:, None] * per_block + np.arange(per_block, dtype=np.int64)[None, :]
    return rows.reshape(-1).astype(np.int32)

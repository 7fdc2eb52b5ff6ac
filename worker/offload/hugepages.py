"""The offload daemon's pool memory, on transparent huge pages where the kernel gives them.

A worker's NIXL READ from the pool and WRITE into it are, on one node, a CMA copy: the
kernel pins the pool's pages one by one on every transfer and copies between them and
the worker's. With 4 KiB pages the pinning costs as much as the copy: a bare READ of
256 MiB took 28-41 ms of CPU from a pool of 4 KiB pages and 16-20 ms from one of 2 MiB
pages (a WRITE 33-37 ms and 20-21 ms; docs/DESIGN-NOTES.md, "Huge pages for the pool").
Linux gives anonymous memory huge pages only where asked (``madvise``, the usual
``transparent_hugepage`` setting), so :func:`allocate_pool` maps the pool itself,
2 MiB-aligned, advises ``MADV_HUGEPAGE`` before any page is touched, zeroes it (faulting
it in, as ``torch.zeros`` did) and lays the layout's tensors over it exactly as
:meth:`KVLayout.allocate` would. Where the advice is refused or unknown (another OS, THP
off) the same memory comes in small pages: nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvbridge.proto.layout import KVLayout

__all__ = ["HUGE_PAGE_BYTES", "allocate_pool"]

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
"""The alignment and advice granule (x86-64's and arm64's usual PMD size)."""


def allocate_pool(layout: KVLayout) -> dict[str, torch.Tensor]:
    """Zeroed KV tensors for ``layout`` (CPU), laid out as :meth:`KVLayout.allocate` lays
    them out (the same views, strides and aliases), each of its buffers mapped 2 MiB-aligned
    with ``MADV_HUGEPAGE`` advised before it is touched."""
    import torch

    shapes = layout.allocate("meta")  # the views, no memory
    real: dict[int, torch.Tensor] = {}  # id of a meta buffer -> its memory
    out: dict[int, torch.Tensor] = {}  # id of a meta view -> the real view (aliases kept)
    tensors = {}
    for name, view in shapes.items():
        if id(view) not in out:
            base = view._base if view._base is not None else view
            if id(base) not in real:
                real[id(base)] = _huge_zeros(base.numel(), base.dtype)
            mem = real[id(base)]
            out[id(view)] = torch.empty(0, dtype=view.dtype).set_(
                mem.untyped_storage(), view.storage_offset(), view.size(), view.stride()
            )
        tensors[name] = out[id(view)]
    return tensors


def _huge_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` zeroed elements in a private anonymous mapping, 2 MiB-aligned, advised
    ``MADV_HUGEPAGE`` (if the kernel takes the advice) before the first touch."""
    import torch

    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = -(-max(nbytes, 1) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    area = mmap.mmap(-1, span + HUGE_PAGE_BYTES, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = (-ctypes.addressof(ctypes.c_char.from_buffer(area))) % HUGE_PAGE_BYTES
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            area.madvise(advice, start, span)
        except OSError as exc:  # THP compiled out or refused: small pages, same memory
            log.info("offload pool: no huge pages (%s)", exc)
    # the tensor keeps the view, and the view the mapping, alive
    flat = torch.frombuffer(memoryview(area)[start : start + span], dtype=torch.uint8)
    flat = flat[:nbytes].view(dtype)
    flat.zero_()
    return flat

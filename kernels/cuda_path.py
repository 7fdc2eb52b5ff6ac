"""The CUDA implementation: every span of a call copied by one cupy ``RawModule`` launch.

Called by :mod:`kvbridge.kernels.ops` when source and destination live on the
same CUDA device. It turns coalesced views (:mod:`kvbridge.kernels.views`)
into a table of ``(src_addr, dst_addr, length)`` byte spans (absolute device
addresses, so per-layer allocations need no extra launches), splits spans
longer than :data:`PIECE_BYTES` so that a few huge blocks still fill the
GPU, uploads the table and launches ``kvb_copy_spans`` (``copy_spans.cu``,
shipped as package data) once on torch's current stream. Tensors are passed
by address: no copies, no DLPack round trips for the data; the span table
goes to cupy through DLPack.

cupy is imported here only, and this module is imported only when a CUDA
tensor is passed. :func:`spans_apply` returns ``False`` (and the caller uses
torch's own CUDA index ops) when the runs are too short to be worth a span
each (e.g. NHD <-> HND conversion) or when cupy is not installed.
"""

from __future__ import annotations

import functools
import logging
import warnings
from importlib import resources
from typing import Any

import torch

__all__ = ["MIN_SPAN_BYTES", "PIECE_BYTES", "build_spans", "spans_apply", "launch_spans"]

log = logging.getLogger(__name__)

#: runs shorter than this are left to torch's CUDA index kernels
MIN_SPAN_BYTES = 256
#: spans are cut into pieces of at most this many bytes (a multiple of 16)
PIECE_BYTES = 64 << 10
_THREADS = 256
_MAX_GRID = 65535


@functools.cache
def _kernel(device_index: int) -> Any:
    """The compiled ``kvb_copy_spans`` for one device (cupy also caches the binary on disk)."""
    import cupy

    source = resources.files("kvbridge.kernels").joinpath("copy_spans.cu").read_text()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source, options=("--std=c++14",))
        return module.get_function("kvb_copy_spans")


def _outer_offsets(t: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Element offsets of every index combination of ``dims`` (row-major), as int64 on CPU."""
    off = torch.zeros(1, dtype=torch.int64)
    for d in dims:
        steps = torch.arange(t.shape[d], dtype=torch.int64) * t.stride(d)
        off = (off[:, None] + steps[None, :]).reshape(-1)
    return off


def spans_apply(src: torch.Tensor, dst: torch.Tensor, dim: int) -> bool:
    """Whether the span kernel can move these coalesced views (contiguous runs, long enough)."""
    if src.dim() < 2 or dim == src.dim() - 1:
        return False
    if src.stride(-1) != 1 or dst.stride(-1) != 1:
        return False
    return src.shape[-1] * src.element_size() >= MIN_SPAN_BYTES


def build_spans(
    src: torch.Tensor, dst: torch.Tensor, dim: int, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> torch.Tensor:
    """An ``(n, 3)`` int64 CPU tensor of ``(src_addr, dst_addr, length)`` for one view pair."""
    elem = src.element_size()
    outer = [d for d in range(src.dim() - 1) if d != dim]
    o_src = _outer_offsets(src, outer)
    o_dst = _outer_offsets(dst, outer)
    s = src_ids.to("cpu", torch.int64)[:, None] * src.stride(dim) + o_src[None, :]
    d = dst_ids.to("cpu", torch.int64)[:, None] * dst.stride(dim) + o_dst[None, :]
    s_addr = s.reshape(-1) * elem + src.data_ptr()
    d_addr = d.reshape(-1) * elem + dst.data_ptr()
    run = src.shape[-1] * elem
    pieces = -(-run // PIECE_BYTES)
    starts = torch.arange(pieces, dtype=torch.int64) * PIECE_BYTES
    lengths = torch.clamp(run - starts, max=PIECE_BYTES)
    spans = torch.empty((s_addr.numel(), pieces, 3), dtype=torch.int64)
    spans[:, :, 0] = s_addr[:, None] + starts[None, :]
    spans[:, :, 1] = d_addr[:, None] + starts[None, :]
    spans[:, :, 2] = lengths[None, :]
    return spans.reshape(-1, 3)


def launch_spans(spans: torch.Tensor, device: torch.device) -> bool:
    """Copy every span with one launch on torch's current stream; False if cupy is missing."""
    n = spans.shape[0]
    if n == 0:
        return True
    try:
        import cupy
    except ImportError:
        warnings.warn(
            "cupy is not installed (pip install 'kvbridge[gpu]'); kvbridge.kernels uses torch's "
            "CUDA index ops instead of its span kernel",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _kernel(index)
    table = spans.to(device, non_blocking=False)
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        table_cp = cupy.from_dlpack(table)
        grid = min(n, _MAX_GRID)
        kernel((grid,), (_THREADS,), (table_cp, cupy.int64(n)))
    # ``table`` came from torch's caching allocator on this same stream, so its memory is
    # not handed out again before the kernel has run
    log.debug("kvb_copy_spans: %d spans on %s", n, device)
    return True

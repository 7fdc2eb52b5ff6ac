"""The torch implementation: vectorised index ops over coalesced views (CPU, and any device).

Called by :mod:`kvbridge.kernels.ops` with views already coalesced and
widened (:mod:`kvbridge.kernels.views`); ``dim`` is the block dimension.
It is the CPU path, the path between two devices (e.g. a CUDA cache and a
host cache: gather on the source device, one ``.to()``, scatter on the
destination device), and the CUDA fallback where the runs are too short for
the span kernel (e.g. NHD <-> HND conversion).

- gather: ``torch.index_select(src, dim, ids, out=dst)``, one pass;
- scatter: ``dst.index_copy_(dim, ids, src)``, one pass;
- copy/convert on CPU (:func:`copy_pairs`): one pass. When the destination
  (or source) ids are one run of consecutive blocks, one gather (scatter)
  per view pair; otherwise one ``torch._foreach_copy_`` of every (block,
  view pair) slice, each a strided ``copy_`` straight from the source block
  into the destination block (an order conversion permutes inside that copy),
  for slices of at least :data:`SLICE_BYTES`;
- copy/convert elsewhere, or when source and destination may overlap
  (:func:`copy_rows`): ``index_select`` into a cache-sized temporary, then
  ``index_copy_``, in steps of about :data:`CHUNK_BYTES` (a 2 MiB Llama-8B
  block moves two to a step, a 32 KiB one 128 to a step). Only blocks bigger
  than the chunk take one step each.

Host memory taking part in a call (a CPU cache or staging buffer) is
finished with when the call returns (copies between devices are blocking);
work on one CUDA device is queued on torch's current stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

__all__ = [
    "CHUNK_BYTES",
    "CUDA_CHUNK_BYTES",
    "SLICE_BYTES",
    "gather_rows",
    "scatter_rows",
    "copy_rows",
    "copy_pairs",
]

#: bytes of the temporary of one copy step (at least one block): small enough to stay in
#: the last-level cache, so the second pass reads it from there, and so that no call
#: faults in a big fresh buffer
CHUNK_BYTES = 4 << 20
#: block slices (one block of one view pair) of at least this many bytes are moved by one
#: strided copy each when neither side's ids are a run (:func:`copy_pairs`); smaller ones
#: by index ops through a temporary, whose per-block cost is lower
SLICE_BYTES = 16 << 10
#: torch's intra-op grain: a CPU copy of fewer elements runs on one thread
GRAIN_ELEMS = 32768
#: the same on a GPU, where each step costs two kernel launches: bigger steps
CUDA_CHUNK_BYTES = 256 << 20


def _on(ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ids if ids.device == t.device else ids.to(t.device, non_blocking=True)


def gather_rows(src: torch.Tensor, dst: torch.Tensor, dim: int, ids: torch.Tensor) -> None:
    """``dst[..., i, ...] = src[..., ids[i], ...]`` along ``dim`` (``dst`` has ``len(ids)``)."""
    if ids.numel() == 0:
        return
    if dst.device == src.device:
        torch.index_select(src, dim, _on(ids, src), out=dst)
    else:
        dst.copy_(torch.index_select(src, dim, _on(ids, src)))


def scatter_rows(src: torch.Tensor, dst: torch.Tensor, dim: int, ids: torch.Tensor) -> None:
    """``dst[..., ids[i], ...] = src[..., i, ...]`` along ``dim`` (ids distinct)."""
    if ids.numel() == 0:
        return
    if src.device != dst.device:
        src = src.to(dst.device)
    dst.index_copy_(dim, _on(ids, dst), src)


def _is_run(ids: torch.Tensor) -> bool:
    """Whether ``ids`` are consecutive ascending block ids."""
    return ids.numel() == 1 or bool((ids.diff() == 1).all())


def _steps(rows: int, n: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` id ranges of at most ``rows`` ids."""
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def copy_pairs(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """``b[dst_ids[i]] = a[src_ids[i]]`` along dim 0 of every pair ``(a, b)``, in one pass.

    For views on one CPU device that do not overlap (gather, scatter, and
    copy/convert between two caches). The path is chosen once for all pairs:

    - a run of consecutive ids on either side (gather and scatter always
      have one: the staging side): one index op per pair, which costs less
      per block than a strided copy;
    - block slices under :data:`SLICE_BYTES`: :func:`copy_rows` (two index
      ops through a temporary; per-call overhead would dominate a per-block
      copy);
    - otherwise one ``torch._foreach_copy_`` of every (block, pair) slice:
      one strided copy per slice straight from source to destination (an
      order conversion permutes inside it), no temporary, split between
      torch's threads when each copy is too small for torch to split.
    """
    n = src_ids.numel()
    if n == 0:
        return
    a0 = pairs[0][0]
    if _is_run(dst_ids):
        start = int(dst_ids[0])
        for a, b in pairs:
            gather_rows(a, b.narrow(0, start, n), 0, src_ids)
        return
    if _is_run(src_ids):
        start = int(src_ids[0])
        for a, b in pairs:
            scatter_rows(a.narrow(0, start, n), b, 0, dst_ids)
        return
    if a0[0].numel() * a0.element_size() < SLICE_BYTES:
        for a, b in pairs:
            copy_rows(a, b, 0, src_ids, dst_ids)
        return
    s_list, d_list = src_ids.tolist(), dst_ids.tolist()
    srcs: list[torch.Tensor] = []
    dsts: list[torch.Tensor] = []
    for a, b in pairs:
        srcs += [a.select(0, i) for i in s_list]
        dsts += [b.select(0, i) for i in d_list]
    # torch runs a copy of fewer than GRAIN_ELEMS elements on one thread: split such slices
    # between torch's threads as its own intra-op parallelism would
    threads = 1 if a0[0].numel() >= GRAIN_ELEMS else torch.get_num_threads()
    _foreach_copy(dsts, srcs, min(threads, len(dsts) * a0[0].numel() // GRAIN_ELEMS))


def _foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], threads: int) -> None:
    """``torch._foreach_copy_(dsts, srcs)`` in ``threads`` contiguous parts at once (torch
    releases the GIL inside; the calling thread does the first part)."""
    if threads <= 1:
        torch._foreach_copy_(dsts, srcs)
        return
    step = -(-len(dsts) // threads)
    errors: list[BaseException] = []

    def part(start: int) -> None:
        try:
            torch._foreach_copy_(dsts[start : start + step], srcs[start : start + step])
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    helpers = [threading.Thread(target=part, args=(i,)) for i in range(step, len(dsts), step)]
    for t in helpers:
        t.start()
    part(0)
    for t in helpers:
        t.join()
    if errors:
        raise errors[0]


def copy_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    dim: int,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    chunked: bool = True,
) -> None:
    """``dst[.., dst_ids[i], ..] = src[.., src_ids[i], ..]``; all reads before writes if unchunked.

    Pass ``chunked=False`` when ``src`` and ``dst`` may overlap (same cache,
    shared ids): one temporary then holds every source block before any write.
    """
    n = src_ids.numel()
    if n == 0:
        return
    if chunked and dim == 0 and src.device == dst.device:
        # one pass when either side is a run of consecutive blocks (e.g. freshly allocated ones)
        if _is_run(dst_ids):
            gather_rows(src, dst.narrow(0, int(dst_ids[0]), n), 0, src_ids)
            return
        if _is_run(src_ids):
            scatter_rows(src.narrow(0, int(src_ids[0]), n), dst, 0, dst_ids)
            return
    s_all, d_all = _on(src_ids, src), _on(dst_ids, dst)
    per_id = src.numel() // max(1, src.shape[dim]) * src.element_size()
    chunk = CUDA_CHUNK_BYTES if src.is_cuda else CHUNK_BYTES
    rows = n if not chunked else min(n, max(1, chunk // max(1, per_id)))
    shape = list(src.shape)
    shape[dim] = rows
    tmp = torch.empty(shape, dtype=src.dtype, device=src.device)
    for start, end in _steps(rows, n):
        part = tmp.narrow(dim, 0, end - start)
        if dim == 0:
            torch.index_select(src, dim, s_all[start:end], out=part)
        else:
            part = torch.index_select(src, dim, s_all[start:end])
        if part.device != dst.device:
            part = part.to(dst.device)
        dst.index_copy_(dim, d_all[start:end], part)

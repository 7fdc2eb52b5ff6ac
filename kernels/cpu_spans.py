"""The compiled CPU span copy: every block of a CPU copy, convert, gather or scatter in one call.

Called by :mod:`kvbridge.kernels.ops` for view pairs on the CPU whose
source and destination do not overlap, before the torch path
(:mod:`kvbridge.kernels.torch_path`). A coalesced view pair
(:mod:`kvbridge.kernels.views`) is, inside one block, a fixed set of
contiguous runs (e.g. one 256-byte ``C`` run per ``(K/V, N, H)`` when an
NHD cache is converted to HND). The runs' byte offsets are computed once
per view shape from the views' own strides; ``cpu_spans.c`` then copies,
for every (block, view pair), every run with ``memcpy``: one C call for
all blocks of all layers, no temporary, no view or ``TensorIterator`` per
block, split between ``torch.get_num_threads()`` threads (the GIL is
released), which claim the work in chunks as they get to run: the calling
thread's OpenMP team in the libgomp torch loaded (the threads torch's own
ops use, kept between calls), or, without libgomp and on the thread that
forked (in the child), pthreads made per call (:func:`helper_threads`). Copies of at
least :data:`STREAM_BYTES` in runs of at least :data:`STREAM_MIN_RUN` bytes
write the destination with non-temporal (streaming) stores on x86-64 (AVX2
where the CPU has it): a plain store first reads each destination line, runs
scattered over a block (the 256-byte heads of an NHD <-> HND conversion) meet
cache-set conflicts, and a copy that big leaves little of its destination in
cache anyway. Smaller copies keep ``memcpy``, so that their destination stays
cached for the reader that usually follows.

The tables of a call (:class:`Plan`, from :func:`plan_pairs`) depend only on
the views' shapes, strides and addresses; :mod:`kvbridge.kernels.cpu_plan`
keeps them between calls.

The helper is an optional extension module (``kvbridge.kernels._cpu_spans``)
that pip builds with the package where a C compiler exists. Without it
:func:`copy_pairs` returns ``False`` and the torch path moves the blocks,
bit-exact all the same; :func:`available` says which one runs.
"""

from __future__ import annotations

import functools
import importlib
from array import array
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple, TypeAlias

import torch

from kvbridge.kernels.views import coalesce, widen

__all__ = [
    "MIN_RUN_BYTES",
    "PART_BYTES",
    "STREAM_BYTES",
    "STREAM_MIN_RUN",
    "Plan",
    "available",
    "copy_pairs",
    "helper_threads",
    "native_module",
    "plan_pairs",
    "run_plan",
]

#: runs shorter than this are left to the torch path (a ``memcpy`` call per few bytes)
MIN_RUN_BYTES = 32
#: the threads claim the work in parts of at least this many bytes, and a call gets no more
#: threads than it has parts
PART_BYTES = 1 << 20
#: calls moving at least this many bytes in runs of at least :data:`STREAM_MIN_RUN` bytes
#: write with streaming stores (smaller copies stay in cache for the reader that usually
#: follows)
STREAM_BYTES = 8 << 20
#: shorter runs would stream partial cache lines
STREAM_MIN_RUN = 64


@functools.cache
def native_module() -> ModuleType | None:
    """The compiled helper, or ``None`` where it was not built."""
    try:
        # a compiled module: it runs no kvbridge code and imports nothing back, so it is no
        # edge of the import graph tests/test_architecture.py checks for cycles
        return importlib.import_module(f"{__package__}._cpu_spans")
    except ImportError:
        return None


def available() -> bool:
    """Whether the compiled span copy is installed (else the torch path runs)."""
    return native_module() is not None


def helper_threads() -> str | None:
    """Where the calling thread's calls get their helper threads: ``"openmp"`` (its team in
    torch's libgomp), ``"pthreads"`` (made per call: no libgomp, or the thread that forked,
    in the child, which may hold its parent's team), or ``None`` where the span copy is not
    built."""
    native = native_module()
    if native is None:
        return None
    kind = getattr(native, "helper_threads", None)  # absent from builds before the teams
    return "pthreads" if kind is None else str(kind())


@functools.lru_cache(maxsize=64)
def _runs(
    shape: tuple[int, ...], src_stride: tuple[int, ...], dst_stride: tuple[int, ...], elem: int
) -> tuple[array[int], array[int], int]:
    """Byte offsets of every run inside one block on each side (sorted by source offset,
    so the source is read front to back) and the run's length in bytes. ``shape`` and the
    strides are a view's dims after the block dim."""
    if shape and src_stride[-1] == 1 and dst_stride[-1] == 1:
        run, outer = shape[-1] * elem, range(len(shape) - 1)
    else:
        run, outer = elem, range(len(shape))
    src = torch.zeros(1, dtype=torch.int64)
    dst = torch.zeros(1, dtype=torch.int64)
    for d in outer:
        steps = torch.arange(shape[d], dtype=torch.int64)
        src = (src[:, None] + steps[None, :] * src_stride[d]).reshape(-1)
        dst = (dst[:, None] + steps[None, :] * dst_stride[d]).reshape(-1)
    order = torch.argsort(src)
    return array("q", (src[order] * elem).tolist()), array("q", (dst[order] * elem).tolist()), run


#: one group of view pairs of equal shapes and strides: the runs (offsets on each side and
#: length), the two block strides in bytes, and the views' first bytes on each side
_Group: TypeAlias = "tuple[tuple[array[int], array[int], int], int, int, array[int], array[int]]"


class Plan(NamedTuple):
    """Everything a span copy of these views needs but the block ids."""

    groups: tuple[_Group, ...]


def _address(a: array[int]) -> int:
    return a.buffer_info()[0]


def plan_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], lead: int = 1) -> Plan | None:
    """The tables of a span copy of ``pairs`` (see :func:`copy_pairs`), or ``None`` when a
    pair's runs are shorter than :data:`MIN_RUN_BYTES`. Pairs of equal shapes and strides
    (e.g. the per-layer tensors of a layer-separate cache) are coalesced once, one group."""
    groups: dict[tuple[object, ...], _Group] = {}
    for a, b in pairs:
        key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype)
        group = groups.get(key)
        if group is None:
            wa, wb = widen(coalesce([a, b], lead=lead))
            runs = _runs(tuple(wa.shape[1:]), wa.stride()[1:], wb.stride()[1:], wa.element_size())
            if runs[2] < MIN_RUN_BYTES:
                return None
            elem = wa.element_size()
            group = groups[key] = (
                runs,
                wa.stride(0) * elem,
                wb.stride(0) * elem,
                array("q"),
                array("q"),
            )
        # a view's first byte is its coalesced view's: same storage offset, reinterpreted
        group[3].append(a.data_ptr())
        group[4].append(b.data_ptr())
    return Plan(tuple(groups.values()))


def run_plan(plan: Plan, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy blocks ``src_ids[i] -> dst_ids[i]`` (checked, CPU int64) of ``plan``'s views."""
    native = native_module()
    assert native is not None, "a plan is made only where the span copy is built"
    if src_ids.dtype != torch.int64 or not src_ids.is_contiguous():
        src_ids = src_ids.to(torch.int64).contiguous()
    if dst_ids.dtype != torch.int64 or not dst_ids.is_contiguous():
        dst_ids = dst_ids.to(torch.int64).contiguous()
    n = src_ids.numel()
    threads_allowed = torch.get_num_threads()
    for (s_runs, d_runs, run), s_block, d_block, s_views, d_views in plan.groups:
        npairs = len(s_views)
        nbytes = n * npairs * len(s_runs) * run
        threads = max(1, min(threads_allowed, nbytes // PART_BYTES))
        stream = nbytes >= STREAM_BYTES and run >= STREAM_MIN_RUN
        native.copy_spans(
            _address(s_views),
            _address(d_views),
            npairs,
            src_ids.data_ptr(),
            dst_ids.data_ptr(),
            n,
            s_block,
            d_block,
            _address(s_runs),
            _address(d_runs),
            len(s_runs),
            run,
            threads,
            stream,
            PART_BYTES,
        )


def copy_pairs(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    lead: int = 1,
) -> bool:
    """``b[:, :, dst_ids[i]] = a[:, :, src_ids[i]]`` for every CPU group-view pair ``(a, b)``.

    ``pairs`` are the group views of :func:`~kvbridge.kernels.views.paired_views`
    (block dim 2), apart from each other, with checked ids (``ops`` sees to
    both); ``lead`` is passed to :func:`~kvbridge.kernels.views.coalesce`.
    Returns ``False``, having moved nothing, when the helper is not built or a
    pair's runs are shorter than :data:`MIN_RUN_BYTES`.
    """
    if native_module() is None:
        return False
    plan = plan_pairs(pairs, lead)
    if plan is None:
        return False
    run_plan(plan, src_ids, dst_ids)
    return True

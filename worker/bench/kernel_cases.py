"""The cases and timing of ``kvbridge bench kernels`` (imports torch; the CLI loads it in ``run``).

Each case is one kvbridge kernel call on a preset's layout plus the torch
baselines that move the same bytes; :func:`measure` times them interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvbridge.kernels import (
    convert_blocks,
    copy_blocks,
    gather_blocks,
    scatter_blocks,
    staging_nbytes,
)
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.presets import preset_layout

__all__ = ["TARGET", "Case", "cases", "measure"]

TARGET = 0.8
_CONVERSIONS = (("block-nhd", "layer-nhd"), ("block-nhd", "block-hnd"), ("layer-nhd", "layer-hnd"))


@dataclass(frozen=True, slots=True)
class Case:
    op: str
    src_order: str
    dst_order: str
    device: str
    nbytes: int
    run: Callable[[], None]
    baselines: dict[str, Callable[[], None]]
    target_vs: str


def _filled(layout: KVLayout, device: str, seed: int) -> dict[str, torch.Tensor]:
    """A cache with every byte written (untouched pages would make reads look free)."""
    cache = layout.allocate(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in layout.owning_layers(KVGroup.SELF):
        raw = cache[layer.name].view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8, device=device))
    return cache


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], None], device: str, clock: Callable[[], float]) -> float:
    _sync(device)
    t0 = clock()
    fn()
    _sync(device)
    return clock() - t0


def _cpu_baselines(
    block_bytes: int, num_blocks: int, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> dict[str, Callable[[], None]]:
    words = block_bytes // 8
    mat = torch.ones(num_blocks, words, dtype=torch.int64)
    out = torch.ones(src_ids.numel(), words, dtype=torch.int64)
    dst = torch.ones(num_blocks, words, dtype=torch.int64)
    flat_src, flat_out = mat[: src_ids.numel()], out

    def index_select() -> None:
        torch.index_select(mat, 0, src_ids, out=out)

    def copy() -> None:
        flat_out.copy_(flat_src)

    def composite() -> None:
        dst.index_copy_(0, dst_ids, torch.index_select(mat, 0, src_ids, out=out))

    return {"index_select": index_select, "copy_": copy, "index_select+index_copy_": composite}


def _cuda_baselines(nbytes: int) -> dict[str, Callable[[], None]]:
    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def d2d() -> None:
        b.copy_(a)

    def d2h() -> None:
        host.copy_(a, non_blocking=True)

    return {"memcpy_d2d": d2d, "memcpy_d2h": d2h}


def cases(args: argparse.Namespace, device: str) -> list[Case]:
    def layout(order: str) -> KVLayout:
        return preset_layout(
            args.preset, block_size=args.block_size, num_blocks=args.num_blocks, order=order
        )

    gen = torch.Generator().manual_seed(0)
    n = min(args.moved, args.num_blocks)
    src_ids = torch.randperm(args.num_blocks, generator=gen)[:n]
    dst_ids = torch.randperm(args.num_blocks, generator=gen)[:n]
    mapping = (src_ids, dst_ids)
    cases: list[Case] = []
    for order in args.orders:
        lay = layout(order)
        nbytes = n * lay.block_bytes()
        if device == "cpu":
            base = _cpu_baselines(lay.block_bytes(), args.num_blocks, src_ids, dst_ids)
            copy_vs, stage_vs = "index_select", "index_select"
            staging = torch.empty(staging_nbytes(lay, n), dtype=torch.uint8)
        else:
            base = _cuda_baselines(nbytes)
            copy_vs, stage_vs = "memcpy_d2d", "memcpy_d2h"
            staging = torch.empty(staging_nbytes(lay, n), dtype=torch.uint8, pin_memory=True)
        src, dst = _filled(lay, device, 1), _filled(lay, device, 2)
        staging.fill_(1)
        copy = partial(copy_blocks, src, dst, lay, mapping)
        gather = partial(gather_blocks, src, lay, src_ids, staging)
        scatter = partial(scatter_blocks, staging, dst, lay, dst_ids)
        cases += [
            Case("copy_blocks", order, order, device, nbytes, copy, base, copy_vs),
            Case("gather_blocks", order, "staging", device, nbytes, gather, base, stage_vs),
            Case("scatter_blocks", "staging", order, device, nbytes, scatter, base, stage_vs),
        ]
    for a, b in _CONVERSIONS:
        la, lb = layout(a), layout(b)
        src, dst = _filled(la, device, 3), _filled(lb, device, 4)
        nbytes = n * la.block_bytes()
        if device == "cpu":
            base = _cpu_baselines(la.block_bytes(), args.num_blocks, src_ids, dst_ids)
        else:
            base = _cuda_baselines(nbytes)
        convert = partial(convert_blocks, src, la, dst, lb, mapping)
        vs = "index_select" if device == "cpu" else "memcpy_d2d"
        cases.append(Case("convert_blocks", a, b, device, nbytes, convert, base, vs))
    return cases


def measure(
    case: Case, repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """GB/s (best run) of the op and each baseline, and the op's ratio to ``case.target_vs``.

    ``clock`` times each run: wall clock, or ``time.thread_time`` (CPU time of this
    thread, right only when every byte moves in it: one torch thread). The runs are
    interleaved (op, then each baseline, ``repeats`` times). ``ratio`` is the median over
    the repeats of ``baseline time / op time`` within one repeat, so that a noisy
    neighbour slowing a stretch of the run slows both sides of each ratio alike;
    ``best ratio`` divides the best runs instead.
    """
    case.run()
    for fn in case.baselines.values():
        fn()
    times: dict[str, list[float]] = {"op": [], **{k: [] for k in case.baselines}}
    for _ in range(repeats):
        times["op"].append(_time(case.run, case.device, clock))
        for name, fn in case.baselines.items():
            times[name].append(_time(fn, case.device, clock))
    # best of the interleaved runs: on a shared machine interference only ever slows a run down
    gbps = {k: case.nbytes / min(v) / 1e9 for k, v in times.items()}
    paired = [b / a for a, b in zip(times["op"], times[case.target_vs], strict=True)]
    row: dict[str, Any] = {
        "op": case.op,
        "device": case.device,
        "src": case.src_order,
        "dst": case.dst_order,
        "MiB": case.nbytes / 2**20,
        "GB/s": gbps["op"],
    }
    for name in case.baselines:
        row[f"{name} GB/s"] = gbps[name]
    row["vs"] = case.target_vs
    row["ratio"] = statistics.median(paired)
    row["best ratio"] = gbps["op"] / gbps[case.target_vs]
    row["meets"] = "yes" if row["ratio"] >= TARGET else "no"
    return row

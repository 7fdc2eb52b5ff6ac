"""``kvbridge bench kernels``: GB/s of the block kernels against torch's own copies.

Each operation of :mod:`kvbridge.kernels` moves ``--moved`` random blocks of a
preset's layout. Right after each timed run the same bytes are moved by the
baselines, interleaved so that a noisy neighbour hurts both alike:

- CPU: ``torch.index_select`` of those blocks from a filled
  ``(num_blocks, block_bytes)`` matrix into a preallocated buffer (the
  equivalent one-pass gather), ``copy_`` of the same number of contiguous
  bytes, and for copy/convert also ``index_select`` + ``index_copy_`` (the
  equivalent torch composite; torch has no one-op block copy);
- CUDA (when available): ``copy_`` device-to-device (cudaMemcpy D2D) and
  device-to-pinned-host (D2H) of the same bytes.

Target: CPU >= 80% of the equivalent ``index_select`` (the median of the per-repeat
ratios); GPU >= 80% of the memcpy peak for spans of 16 KiB or more.
"""

from __future__ import annotations

import argparse

from kvbridge.proto.presets import PRESETS
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths, settings_of
from kvbridge.worker.bench.report import bar_plot, print_table, progress, write_json
from kvbridge.worker.cli_checks import non_negative_int, positive_int

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("kernels", help="GB/s of block copy/convert/gather/scatter vs torch")
    p.add_argument(
        "--model", "--preset", dest="preset", default="llama3-8b", choices=sorted(PRESETS)
    )
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--num-blocks", type=positive_int, default=64, help="blocks per cache")
    p.add_argument("--moved", type=positive_int, default=32, help="blocks moved per call")
    p.add_argument("--orders", nargs="+", default=["block-nhd", "layer-nhd", "layer-kv-nhd"])
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=15,
        help="interleaved runs (median ratio, best GB/s)",
    )
    p.add_argument(
        "--threads", type=non_negative_int, default=0, help="torch CPU threads (0: default)"
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: CPU time of the one thread that moves the bytes (for a loaded machine; "
        "implies --threads 1 and the CPU only)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    add_output_arguments(p, "kernels")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from kvbridge.kernels.cpu_spans import available, helper_threads
    from kvbridge.worker.bench.kernel_cases import TARGET, cases, measure

    clock = time.perf_counter
    if args.clock == "cpu":  # helper threads would not be counted: one thread, CPU only
        args.threads, args.device, clock = 1, "cpu", time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"]
    if args.device in ("auto", "cuda") and torch.cuda.is_available():
        devices.append("cuda")
    elif args.device == "cuda":
        print("no CUDA device: measuring the CPU path only")
    if args.device == "cuda" and "cuda" in devices:
        devices = ["cuda"]
    rows = []
    for device in devices:
        todo = cases(args, device)
        for case in progress(todo, desc=f"kernels on {device}", total=len(todo)):
            rows.append(measure(case, args.repeats, clock))
    columns = ["op", "device", "src", "dst", "MiB", "GB/s"]
    columns += sorted({k for r in rows for k in r if k.endswith("GB/s") and k != "GB/s"})
    columns += ["vs", "ratio", "best ratio", "meets"]
    print_table(rows, columns)
    threads = torch.get_num_threads()
    helpers = {"openmp": "the calling thread's OpenMP team", "pthreads": "pthreads per call"}
    if available():
        how = helpers.get(helper_threads() or "", helper_threads()) if threads > 1 else "no helper"
        path_name = f"compiled span copy, up to {threads} thread(s) ({how}, claiming 1 MiB parts)"
    else:
        path_name = f"torch ops (span copy not built), {threads} torch thread(s)"
    print(
        f"CPU: kvbridge {path_name}; baselines torch with {threads} intra-op thread(s) "
        f"(OpenMP); clock {args.clock}; target: 'ratio' (median of the per-repeat "
        f"ratios to the baseline in 'vs') >= {TARGET:.0%}"
    )
    settings = settings_of(args)
    settings["threads"] = threads
    settings["cpu_path"] = "span copy" if available() else "torch"
    settings["threads_kvbridge"] = threads  # at most: a call of under `threads` MiB uses fewer
    settings["helper_threads"] = helper_threads()  # openmp (torch's libgomp) / pthreads / None
    settings["threads_baseline"] = threads
    json_path, png_path = output_paths(args.out)
    path = write_json(json_path, {"settings": settings, "rows": rows})
    labels = [f"{r['op']}\n{r['src']}->{r['dst']} {r['device']}" for r in rows]
    series = {
        "kvbridge": [r["GB/s"] for r in rows],
        "baseline (vs)": [r[f"{r['vs']} GB/s"] for r in rows],
    }
    bar_plot(png_path, f"block kernels, {args.preset}", labels, series, "GB/s")
    print(f"wrote {path} and {png_path}")
    return 0

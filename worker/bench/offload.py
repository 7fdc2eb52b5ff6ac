"""``kvbridge bench offload``: store/load bandwidth through the offload daemon, lookup latency.

For each preset and block size a daemon process starts (``kvbridge offload
serve`` via ``python -m``, its pool sized for the case) and this process acts
as the worker: an :class:`~kvbridge.connector.offload.client.OffloadClient`
over its own NIXL transport. In the same run it measures single-thread memcpy
of the same bytes, then ``store`` (PrepareStore → NIXL WRITE → CommitStore,
new hashes each time) and ``load`` (PrepareLoad → NIXL READ → CompleteLoad)
of ``--mib`` MiB, best of ``--repeats``; and the latency of a 10k-hash
``lookup``. Loads run twice per repeat, in alternating order: verified (every
block's digest checked after the READ, the default) and unverified
(``OffloadClientConfig.verify`` off), so the check's cost is a same-run ratio;
``verify_gbps`` is the digest check alone. Stores always digest what they
write. Each repeat also moves the same blocks with bare NIXL WRITE and READ
calls on the client's own link to the pool
(:func:`~kvbridge.worker.bench.bare_nixl.bare_move`), before or after the
store and the loads in alternating order: ``raw_write_gbps`` /
``raw_read_gbps``, and ``store_vs_raw`` / ``load_vs_raw`` (medians of the
per-repeat ratios, so that a busy machine slows both sides alike; ``*_vs_raw_best``: best
time against best time, each side's least disturbed repeat). ``*_cpu_vs_raw``: this
process's CPU time (all threads) for raw NIXL over ours, medians: what a step costs where
no core is idle (then the digest cannot hide beside the transfer), whatever share of the
cores the loaded machine gave it. Targets:
store and load >= 70% of memcpy for >= 1 MiB blocks and >= 80% of raw NIXL;
10k-hash lookup <= 5 ms.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.presets import preset_layout
from kvbridge.proto.types import BlockHash, BlockId
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths, settings_of
from kvbridge.worker.bench.report import bar_plot, percentile, print_table, progress, write_json
from kvbridge.worker.cli_checks import positive_int

__all__ = ["add_parser", "run"]

MiB = 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("offload", help="store/load through the CPU offload daemon vs memcpy")
    p.add_argument(
        "--models", "--presets", dest="presets", nargs="+", default=["llama3-8b", "small"]
    )
    p.add_argument("--block-sizes", type=positive_int, nargs="+", default=[16, 64])
    p.add_argument("--mib", type=positive_int, default=256, help="MiB per store/load")
    p.add_argument("--repeats", type=positive_int, default=3, help="bandwidth: best of this many")
    p.add_argument("--lookup-hashes", type=positive_int, default=10_000)
    p.add_argument("--lookup-repeats", type=positive_int, default=50)
    p.add_argument("--quick", action="store_true", help="one preset, 64 MiB: well under a minute")
    p.add_argument(
        "--disk",
        metavar="DIR",
        help="also measure the disk tier (demote/promote) against a plain sequential "
        "write/read of the same bytes to a file in DIR (rows `disk_rows`, plot *-disk.png)",
    )
    add_output_arguments(p, "offload")
    p.set_defaults(func=run)


def _hashes(tag: str, n: int) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{tag}-{i}".encode()).digest()) for i in range(n)]


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best / 1e9


class _Daemon:
    """An offload daemon subprocess; :meth:`stop` always ends it."""

    def __init__(self, capacity_bytes: int) -> None:
        env = {**os.environ, "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge.worker.offload.cmd",
                "--capacity",
                str(capacity_bytes),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "listening on" in line:
                self.address = line.split("listening on ")[1].split(",")[0].strip()
                return
        self.stop()
        raise KVBridgeError("the offload daemon did not start (run `kvbridge offload serve -v`)")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _case(args: argparse.Namespace, preset: str, block_size: int) -> dict[str, Any]:
    from kvbridge.connector.offload.client import OffloadClient, OffloadClientConfig
    from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport
    from kvbridge.worker.bench.bare_nixl import bare_move

    block_bytes = preset_layout(preset, block_size=block_size, num_blocks=1).block_bytes()
    n = max(1, args.mib * MiB // block_bytes)
    layout = preset_layout(preset, block_size=block_size, num_blocks=n)
    nbytes = n * block_bytes
    memcpy = _memcpy_gbps(nbytes, args.repeats)
    daemon = _Daemon(capacity_bytes=(n + 1) * block_bytes)
    try:
        with NixlTransport(NixlConfig(f"bench-offload-worker-{os.getpid()}")) as transport:
            kv = layout.allocate()
            for t in kv.values():
                t.fill_(1)
            memory = transport.register(layout, kv)
            # a bench measures bandwidth, not the 2 s RPC deadline: on a loaded machine a
            # starved daemon answered PrepareStore late and stopped whole runs
            config = OffloadClientConfig(
                address=daemon.address, engine_id="bench-offload", rpc_timeout_s=10.0
            )
            with OffloadClient(config, transport, memory) as client:
                ids = [BlockId(i) for i in range(n)]
                store_s: list[float] = []
                load_s: dict[bool, list[float]] = {True: [], False: []}
                verify_s: list[float] = []
                raw_s: dict[str, list[float]] = {"write": [], "read": []}
                # this process's CPU seconds (all its threads) per step: what it costs on
                # a machine with no idle core, whatever share of a core the step got
                cpu: dict[str, list[float]] = {}
                hashes: list[BlockHash] = []

                def raw(op: str) -> None:
                    # the client's link to the pool; slots 0..n-1 hold what the store wrote
                    # (the same bytes: every block of the KV is filled with ones)
                    session = client._session
                    if session is not None and session.staging is None:
                        c0 = time.process_time()
                        raw_s[op].append(bare_move(transport, session.link, op, ids, ids))
                        cpu.setdefault(f"raw_{op}", []).append(time.process_time() - c0)

                for r in range(args.repeats):
                    hashes = _hashes(f"{preset}-{block_size}-{r}", n)
                    if r % 2:
                        raw("write")
                    c0, t0 = time.process_time(), time.perf_counter()
                    stored = client.store(ids, hashes)
                    store_s.append(time.perf_counter() - t0)
                    cpu.setdefault("store", []).append(time.process_time() - c0)
                    if stored.stored != n:
                        raise KVBridgeError(f"store wrote {stored.stored} of {n}: {stored.error}")
                    if r % 2 == 0:
                        raw("write")
                    order = ("raw", True, False) if r % 2 else (True, False, "raw")
                    for verify in order:
                        if verify == "raw":
                            raw("read")
                            continue
                        client.config = replace(config, verify=bool(verify))
                        c0, t0 = time.process_time(), time.perf_counter()
                        loaded = client.load(ids, hashes)
                        load_s[bool(verify)].append(time.perf_counter() - t0)
                        step = "load" if verify else "load_unverified"
                        cpu.setdefault(step, []).append(time.process_time() - c0)
                        if loaded.loaded != n:
                            raise KVBridgeError(f"load read {loaded.loaded} of {n}: {loaded.error}")
                        if verify:
                            verify_s.append(loaded.verify_s)
                    client.config = config
                lookup = hashes + _hashes("absent", max(0, args.lookup_hashes - n))
                lookup = lookup[: args.lookup_hashes]
                lat = []
                for _ in range(args.lookup_repeats):
                    t0 = time.perf_counter()
                    client.lookup(lookup)
                    lat.append(time.perf_counter() - t0)
    finally:
        daemon.stop()
    store = nbytes / min(store_s) / 1e9
    load = nbytes / min(load_s[True]) / 1e9
    unverified = nbytes / min(load_s[False]) / 1e9
    # the first repeat's raw WRITE came after the client's first connect: all repeats pair up
    raw_w, raw_r = raw_s["write"], raw_s["read"]
    paired = len(raw_w) == len(store_s) and len(raw_r) == len(store_s)
    return {
        "preset": preset,
        "block_size": block_size,
        "block_kib": block_bytes / 1024,
        "blocks": n,
        "mib": nbytes / MiB,
        "memcpy_gbps": memcpy,
        "store_gbps": store,
        "load_gbps": load,
        "store_pct": 100 * store / memcpy,
        "load_pct": 100 * load / memcpy,
        "load_unverified_gbps": unverified,
        "verified_over_unverified": load / unverified,
        "verify_gbps": nbytes / max(min(verify_s), 1e-9) / 1e9,
        "lookup_p50_ms": percentile(lat, 50) * 1e3,
        "lookup_p99_ms": percentile(lat, 99) * 1e3,
        "raw_write_gbps": nbytes / min(raw_w) / 1e9 if paired else None,
        "raw_read_gbps": nbytes / min(raw_r) / 1e9 if paired else None,
        "store_vs_raw": _median_ratio(raw_w, store_s) if paired else None,
        "load_vs_raw": _median_ratio(raw_r, load_s[True]) if paired else None,
        "load_unverified_vs_raw": _median_ratio(raw_r, load_s[False]) if paired else None,
        # best against best: each side's least disturbed repeat (steadier on a busy machine)
        "store_vs_raw_best": min(raw_w) / min(store_s) if paired else None,
        "load_vs_raw_best": min(raw_r) / min(load_s[True]) if paired else None,
        # CPU seconds of this process, raw over ours (medians of the repeats); the daemon's
        # own CPU (its RPC handlers) is not in them
        "store_cpu_vs_raw": _cpu_ratio(cpu, "raw_write", "store") if paired else None,
        "load_cpu_vs_raw": _cpu_ratio(cpu, "raw_read", "load") if paired else None,
        "load_unverified_cpu_vs_raw": (
            _cpu_ratio(cpu, "raw_read", "load_unverified") if paired else None
        ),
    }


def _cpu_ratio(cpu: dict[str, list[float]], raw: str, ours: str) -> float:
    """Median CPU seconds of the raw step over the median of ours (1 = as little CPU)."""
    return statistics.median(cpu[raw]) / max(statistics.median(cpu[ours]), 1e-9)


def _median_ratio(raw: list[float], ours: list[float]) -> float:
    """Median over the repeats of raw NIXL's time over ours (1 = as fast as raw NIXL)."""
    return statistics.median(b / a for a, b in zip(ours, raw, strict=True))


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.presets, args.block_sizes, args.mib = args.presets[:1], [16], 64
    cases = [(p, bs) for p in args.presets for bs in args.block_sizes]
    rows = [_case(args, p, bs) for p, bs in progress(cases, "offload cases", len(cases))]
    print_table(
        rows,
        ["preset", "block_size", "block_kib", "mib", "memcpy_gbps", "store_gbps", "load_gbps",
         "load_unverified_gbps", "verify_gbps", "raw_write_gbps", "raw_read_gbps",
         "store_vs_raw", "load_vs_raw", "load_unverified_vs_raw", "store_vs_raw_best",
         "load_vs_raw_best", "store_cpu_vs_raw", "load_cpu_vs_raw", "store_pct", "load_pct",
         "lookup_p50_ms", "lookup_p99_ms"],
    )  # fmt: skip
    big = [r for r in rows if r["block_kib"] >= 1024]
    for r in big:
        verdict = "meets" if min(r["store_pct"], r["load_pct"]) >= 70 else "misses"
        print(
            f"{r['preset']} bs={r['block_size']}: store {r['store_pct']:.0f}%, load "
            f"{r['load_pct']:.0f}% of memcpy ({verdict} the 70% target)"
        )
    for r in rows:
        if r["store_vs_raw"] is not None:
            low = min(r["store_vs_raw"], r["load_vs_raw"])
            print(
                f"{r['preset']} bs={r['block_size']}: store {r['store_vs_raw']:.2f}, load "
                f"{r['load_vs_raw']:.2f} of raw NIXL WRITE/READ of the same bytes "
                f"({'meets' if low >= 0.8 else 'misses'} the 0.8 target); CPU: raw's over "
                f"ours {r['store_cpu_vs_raw']:.2f} / {r['load_cpu_vs_raw']:.2f}"
            )
    worst = max(r["lookup_p50_ms"] for r in rows)
    verdict = "meets" if worst <= 5 else "misses"
    print(f"{args.lookup_hashes}-hash lookup p50 <= {worst:.2f} ms ({verdict} the 5 ms target)")
    saving = [1 - r["verified_over_unverified"] for r in rows]
    print(
        f"verification costs {100 * min(saving):.0f}-{100 * max(saving):.0f}% of load "
        "bandwidth (verified vs unverified, same run)"
    )
    from kvbridge.connector.offload import moves

    settings = {
        **settings_of(args),
        "verify": "both: load_gbps verified, load_unverified_gbps not",
        "max_piece_mib": moves.MAX_PIECE_BYTES / MiB,
    }
    json_path, png_path = output_paths(args.out)
    disk_rows = _disk_rows(args, cases, png_path)
    path = write_json(json_path, {"settings": settings, "rows": rows, "disk_rows": disk_rows})
    labels = [f"{r['preset']}/{r['block_size']}" for r in rows]
    keys = ("memcpy", "raw_write", "store", "raw_read", "load", "load_unverified")
    series = {k: [r[f"{k}_gbps"] or 0.0 for r in rows] for k in keys}
    bar_plot(png_path, "offload daemon vs raw NIXL and memcpy (best of runs)", labels,
             series, "GB/s")  # fmt: skip
    print(f"wrote {path} and {png_path}")
    return 0


def _disk_rows(args: argparse.Namespace, cases: list[tuple[str, int]], png: Any) -> list[Any]:
    if args.disk is None:
        return []
    from kvbridge.worker.bench.offload_disk import disk_case

    rows = []
    for preset, bs in cases:
        block_bytes = preset_layout(preset, block_size=bs, num_blocks=1).block_bytes()
        rows.append(disk_case(args.disk, block_bytes, args.mib, args.repeats, f"{preset}/{bs}"))
    print_table(
        rows,
        ["case", "block_kib", "mib", "demote_gbps", "plain_write_gbps", "promote_gbps",
         "plain_read_gbps", "demote_over_write", "promote_over_read", "cache_dropped"],
    )  # fmt: skip
    keys = ("demote", "plain_write", "promote", "plain_read")
    series = {k: [r[f"{k}_gbps"] for r in rows] for k in keys}
    disk_png = png.with_name(png.stem + "-disk" + png.suffix)
    bar_plot(disk_png, f"disk tier vs plain file I/O in {args.disk} (best of runs)",
             [r["case"] for r in rows], series, "GB/s")  # fmt: skip
    print(f"wrote {disk_png}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbridge.worker.bench.offload`` (the same as ``kvbridge bench offload``)."""
    parser = argparse.ArgumentParser(prog="kvbridge")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    args = parser.parse_args(["offload", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

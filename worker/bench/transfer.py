"""``kvbridge bench transfer``: whole-block transfers between two processes on loopback.

For each transport setting (default UCX, ``UCX_TLS=tcp``) a NIXL target and
a reader process start; for each preset and block size the reader measures,
in the same run, single-thread memcpy of the same bytes and one raw READ of
one contiguous region of that size (``raw_gbps``), then, per layout
(block-outermost vs layer-separate) and block order (random vs sequential),
READ and WRITE bandwidth, descriptors per
transfer, descriptor prep time and p50/p99 latency of 1k/8k/32k-token
requests. Each READ is also timed interleaved, repeat by repeat, with bare
NIXL calls moving the same blocks on the same prepped lists (one descriptor
per block on a block-outermost link: ``vs_bare_nixl``) and with the
one-region READ of the same bytes (``vs_raw_paired``); both are medians of
per-repeat ratios, so that a busy machine slows both sides alike. Targets,
as ratios in one run: block-outermost >= 1.5x layer-separate at 16-token
blocks, >= 70% of memcpy for >= 1 MiB blocks, >= 90% of raw NIXL moving the
same bytes.

``--target-device`` / ``--reader-device`` put either side's KV pool on the GPU
(``cuda``): NIXL then registers VRAM. The reference copy is then torch's copy
of the same bytes between the two devices in the reader process
(``memcpy_gbps``: device-to-device, or pinned host <-> device), and every row
also carries a device-to-device copy of the same bytes (``d2d_gbps``,
``vs_d2d``), all in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack

from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.presets import preset_layout
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths, settings_of
from kvbridge.worker.bench.report import bar_plot, print_table, progress, write_json
from kvbridge.worker.cli_checks import positive_float, positive_int

__all__ = ["add_parser", "run"]

TRANSPORTS = {"default": {}, "tcp": {"UCX_TLS": "tcp"}}
ORDERS = {"block-outermost": "block-nhd", "layer-separate": "layer-nhd"}
DEVICES = ("cpu", "cuda")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("transfer", help="NIXL block transfers between two local processes")
    p.add_argument(
        "--models", "--presets", dest="presets", nargs="+", default=["llama3-8b", "small"]
    )
    p.add_argument("--block-sizes", type=positive_int, nargs="+", default=[16, 32, 64])
    p.add_argument(
        "--transports", nargs="+", choices=sorted(TRANSPORTS), default=["default", "tcp"]
    )
    p.add_argument("--mib", type=positive_int, default=256, help="MiB moved per bandwidth transfer")
    p.add_argument("--repeats", type=positive_int, default=3, help="bandwidth: best of this many")
    p.add_argument("--request-tokens", type=positive_int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--latency-repeats", type=positive_int, default=20)
    p.add_argument(
        "--max-pool-mib",
        type=positive_int,
        default=1024,
        help="largest KV pool per side (caps requests)",
    )
    p.add_argument(
        "--target-progress-us",
        type=positive_float,
        default=500.0,
        help="target's progress poll interval",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, default transport: < 1 min")
    p.add_argument(
        "--target-device",
        choices=DEVICES,
        default="cpu",
        help="where the target's KV pool lives (cuda: VRAM registered with NIXL)",
    )
    p.add_argument(
        "--reader-device", choices=DEVICES, default="cpu", help="where the reader's KV pool lives"
    )
    add_output_arguments(p, "transfer")
    p.set_defaults(func=run)


class _Proc:
    """A spawned bench peer (see :mod:`kvbridge.worker.bench.transfer_peer`)."""

    def __init__(self, name: str, env: dict[str, str], progress_s: float) -> None:
        from kvbridge.worker.bench.transfer_peer import serve

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = name
        self.proc = ctx.Process(target=serve, args=(name, child, env, progress_s), daemon=True)
        self.proc.start()

    def ready(self, timeout_s: float = 120.0) -> None:
        if not self.conn.poll(timeout_s):
            raise KVBridgeError(f"bench peer {self.name} did not start in {timeout_s:.0f} s")
        self.conn.recv_bytes()

    def __call__(self, rpc: str, /, **kwargs: Any) -> dict[str, Any]:
        self.conn.send_bytes(msgpack.packb({"rpc": rpc, **kwargs}, use_bin_type=True))
        if not self.conn.poll(600):
            raise KVBridgeError(f"bench peer {self.name} did not answer {rpc} in 600 s")
        reply: dict[str, Any] = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        if not reply.pop("ok"):
            raise KVBridgeError(f"bench peer {self.name}: {rpc} failed: {reply['error']}")
        return reply

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(msgpack.packb({"rpc": "stop"}))
                if self.conn.poll(30):
                    self.conn.recv_bytes()
            except (OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@contextmanager
def _peers(transport: str, progress_s: float) -> Iterator[tuple[_Proc, _Proc]]:
    env = TRANSPORTS[transport]
    target = _Proc(f"bench-target-{transport}", env, progress_s)
    reader = _Proc(f"bench-reader-{transport}", env, 0.002)
    try:
        target.ready()
        reader.ready()
        yield target, reader
    finally:
        reader.stop()
        target.stop()


def _pair(
    target: _Proc, reader: _Proc, args: argparse.Namespace, key: str, **setup: Any
) -> dict[str, Any]:
    t = target("setup", key=key, device=args.target_device, **setup)
    reader("setup", key=key, device=args.reader_device, **setup)
    link = reader("connect", key=key, peer=target.name, metadata=t["metadata"], layout=t["layout"])
    return {**link, "metadata": t["metadata"], "layout": t["layout"]}


def _drop(target: _Proc, reader: _Proc, key: str) -> None:
    reader("drop", key=key)
    target("drop", key=key)


def _cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    return [(t, p, bs) for t in args.transports for p in args.presets for bs in args.block_sizes]


def _measure(
    target: _Proc,
    reader: _Proc,
    args: argparse.Namespace,
    transport: str,
    preset: str,
    bs: int,
) -> list[dict[str, Any]]:
    block_bytes = preset_layout(preset, block_size=bs, num_blocks=1).block_bytes()
    n = max(1, args.mib * 2**20 // block_bytes)
    pool = max(2 * n, min(max(args.request_tokens) // bs, args.max_pool_mib * 2**20 // block_bytes))
    nbytes = n * block_bytes
    copies = reader(
        "memcpy",
        nbytes=nbytes,
        repeats=args.repeats,
        src=args.target_device,
        dst=args.reader_device,
    )
    memcpy, d2d = copies["gbps"], copies.get("d2d_gbps")
    raw_link = _pair(
        target, reader, args, "raw", preset=preset, block_size=bs * n, num_blocks=1,
        order="block-nhd",
    )  # fmt: skip
    raw = reader("bandwidth", key="raw", op="read", pattern="sequential", n=1,
                 repeats=args.repeats, seed=0)["gbps"]  # fmt: skip
    rows = []
    for kind, order in ORDERS.items():
        link = _pair(
            target, reader, args, kind, preset=preset, block_size=bs, num_blocks=pool, order=order
        )
        # the target's new registration changed its metadata, which took the raw link down:
        # link the raw region again with the same metadata, for the interleaved comparison
        reader("connect", key="raw", peer=target.name, metadata=link["metadata"],
               layout=raw_link["layout"])  # fmt: skip
        latency: dict[str, Any] = {}
        for tokens in args.request_tokens:
            k = -(-tokens // bs)
            if k > pool:
                latency[f"p50_ms_{tokens // 1024}k"] = latency[f"p99_ms_{tokens // 1024}k"] = None
                continue
            lat = reader("latency", key=kind, n=k, repeats=args.latency_repeats, seed=tokens)
            latency[f"p50_ms_{tokens // 1024}k"] = lat["p50_ms"]
            latency[f"p99_ms_{tokens // 1024}k"] = lat["p99_ms"]
        for pattern in ("random", "sequential"):
            common = {"key": kind, "pattern": pattern, "n": n, "repeats": args.repeats, "seed": 1}
            rd = reader("bandwidth", op="read", **common)
            wr = reader("bandwidth", op="write", **common)
            # the same READs interleaved with bare NIXL calls on the same lists and with
            # the one-region READ of the same bytes
            bare = reader("bare", op="read", raw_key="raw", **common)
            rows.append(
                {
                    "transport": transport,
                    "devices": f"{args.target_device}->{args.reader_device}",
                    "preset": preset,
                    "layout": kind,
                    "pattern": pattern,
                    "block_tokens": bs,
                    "block_bytes": block_bytes,
                    "blocks": n,
                    "descriptors_per_block": link["descriptors_per_block"],
                    "descriptors": rd["descriptors"],
                    "prep_ms": link["prep_s"] * 1e3,
                    "pool_blocks": pool,
                    "gbps": rd["gbps"],
                    "median_gbps": rd["median_gbps"],
                    "write_gbps": wr["gbps"],
                    "memcpy_gbps": memcpy,
                    "raw_gbps": raw,
                    "vs_memcpy": rd["gbps"] / memcpy,
                    "vs_raw": rd["gbps"] / raw,
                    "bare_nixl_gbps": bare["bare_gbps"],
                    "vs_bare_nixl": bare["vs_bare"],
                    "vs_raw_paired": bare["vs_raw"],
                    "d2d_gbps": d2d,
                    "vs_d2d": rd["gbps"] / d2d if d2d else None,
                    "write_vs_d2d": wr["gbps"] / d2d if d2d else None,
                    **latency,
                }
            )
        _drop(target, reader, kind)
    _drop(target, reader, "raw")
    return rows


def _ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Block-outermost over layer-separate, per transport, preset, block size, pattern."""
    out = []
    by = {
        (r["transport"], r["preset"], r["block_tokens"], r["pattern"], r["layout"]): r for r in rows
    }
    for (t, p, bs, pat, kind), r in by.items():
        other = by.get((t, p, bs, pat, "layer-separate"))
        if kind == "block-outermost" and other is not None:
            out.append(
                {
                    "transport": t,
                    "preset": p,
                    "block_tokens": bs,
                    "pattern": pat,
                    "block_mib": r["block_bytes"] / 2**20,
                    "outermost_vs_layer": r["gbps"] / other["gbps"],
                    "outermost_vs_memcpy": r["vs_memcpy"],
                    "outermost_vs_raw": r["vs_raw"],
                    "outermost_vs_raw_paired": r["vs_raw_paired"],
                    "outermost_vs_bare_nixl": r["vs_bare_nixl"],
                    "outermost_vs_d2d": r["vs_d2d"],
                    "layer_vs_d2d": other["vs_d2d"],
                }
            )
    return out


def run(args: argparse.Namespace) -> int:
    if "cuda" in (args.target_device, args.reader_device):
        import torch

        if not torch.cuda.is_available():
            flags = [f"--{side}-device cuda" for side in ("target", "reader")]
            sides = (args.target_device, args.reader_device)
            given = [f for f, device in zip(flags, sides, strict=True) if device != "cpu"]
            raise KVBridgeError(
                f"{' '.join(given)} needs a CUDA device, and this torch ({torch.__version__}) "
                f"sees none; leave {'them' if len(given) > 1 else 'it'} out (cpu) here"
            )
    if args.quick:
        args.transports = ["default"]
        args.mib = min(args.mib, 32)
        args.repeats = 2
        args.request_tokens = [1024, 8192]
        args.latency_repeats = 5
        args.max_pool_mib = 128
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    cases = _cases(args)
    bar = progress(iter(cases), "bench transfer", total=len(cases))
    current: tuple[str, _Proc, _Proc] | None = None
    stack: Any = None
    try:
        for transport, preset, bs in bar:
            if current is None or current[0] != transport:
                if stack is not None:
                    stack.__exit__(None, None, None)
                stack = _peers(transport, args.target_progress_us * 1e-6)
                target, reader = stack.__enter__()
                current = (transport, target, reader)
            rows += _measure(current[1], current[2], args, transport, preset, bs)
    finally:
        if stack is not None:
            stack.__exit__(None, None, None)
    columns = ["transport", "devices", "preset", "layout", "pattern", "block_tokens",
               "descriptors", "prep_ms", "gbps", "write_gbps", "memcpy_gbps",
               "d2d_gbps", "raw_gbps", "bare_nixl_gbps", "vs_bare_nixl", "vs_raw_paired",
               "p50_ms_1k", "p99_ms_1k", "p50_ms_8k", "p99_ms_8k", "p50_ms_32k", "p99_ms_32k",
               ]  # fmt: skip
    print_table(rows, columns)
    ratios = _ratios(rows)
    print()
    print_table(ratios, list(ratios[0]) if ratios else [])
    settings = settings_of(args)
    json_path, png_path = output_paths(args.out)
    path = write_json(
        json_path,
        {
            "settings": settings,
            "seconds": time.monotonic() - t0,
            "rows": rows,
            "ratios": ratios,
        },
    )
    labels = [
        f"{r['transport']}/{r['preset']}/{r['block_tokens']}/{r['pattern'][:3]}" for r in ratios
    ]
    series = {
        "block-outermost": [r["gbps"] for r in rows if r["layout"] == "block-outermost"],
        "layer-separate": [r["gbps"] for r in rows if r["layout"] == "layer-separate"],
        "memcpy": [r["memcpy_gbps"] for r in rows if r["layout"] == "block-outermost"],
        "raw (one region)": [r["raw_gbps"] for r in rows if r["layout"] == "block-outermost"],
    }
    if any(r["d2d_gbps"] for r in rows):
        series["d2d copy"] = [r["d2d_gbps"] for r in rows if r["layout"] == "block-outermost"]
    where = f"{args.target_device} -> {args.reader_device}"
    title = f"NIXL READ between two processes, {where}"
    bar_plot(png_path, title, labels, series, "GB/s")
    print(f"wrote {path} and {png_path} in {time.monotonic() - t0:.0f} s")
    return 0

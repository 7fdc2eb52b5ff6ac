"""``kvbridge bench control``: latency and rate of control-plane calls on loopback.

The server runs in a child process (as a prefill worker would), with a pool
whose blocks are cached under the hashes the client pins, so every ``Pin``
finds and pins ``--blocks`` blocks. One client calls sequentially; each
operation's latency is timed on its own.

Target: a ``Pin`` + ``Release`` round trip in <= 1 ms p50 on loopback.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths
from kvbridge.worker.bench.report import bar_plot, percentile, print_table, progress, write_json
from kvbridge.worker.cli_checks import add_preset_argument, non_negative_int, positive_int

__all__ = ["add_parser", "run"]

TARGET_PIN_RELEASE_P50_MS = 1.0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("control", help="latency and RPC/s of the gRPC control plane")
    add_preset_argument(p, "model", "llama3-8b")
    p.add_argument("--blocks", type=positive_int, default=64, help="blocks per Pin (default 64)")
    p.add_argument(
        "--iterations", type=positive_int, default=2000, help="timed calls per operation"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=200, help="untimed calls per operation first"
    )
    p.add_argument("--token", default=None, help="also exercise token auth with this token")
    p.add_argument(
        "--in-process", action="store_true", help="run the server in this process (GIL-shared)"
    )
    add_output_arguments(p, "control")
    p.set_defaults(func=run)


def bench_hashes(n: int) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(i.to_bytes(4, "little")).digest()) for i in range(n)]


def _start_server(preset: str, blocks: int, token: str | None) -> Any:
    """Build a prefill-like control server whose pool caches ``bench_hashes(blocks)``."""
    from kvbridge.connector.control.server import ControlServerConfig, serve
    from kvbridge.connector.control.types import PeerInfo, Role
    from kvbridge.connector.server_options import ServerOptions
    from kvbridge.proto.presets import preset_layout
    from kvbridge.proto.types import EngineId
    from kvbridge.worker.block_pool import BlockPool
    from kvbridge.worker.pool_owner import PoolBlockOwner

    layout = preset_layout(preset, num_blocks=max(1024, 2 * blocks))
    pool = BlockPool(layout.group(KVGroup.SELF).num_blocks)
    ids = pool.allocate(blocks)
    for block_id, block_hash in zip(ids, bench_hashes(blocks), strict=True):
        pool.cache_block(block_id, block_hash)
    pool.free(ids)
    owner = PoolBlockOwner({KVGroup.SELF: pool})
    local = PeerInfo(EngineId("bench-prefill"), Role.PREFILL, layout, agent_metadata=b"x" * 512)
    return serve(local, owner, ControlServerConfig(listen=ServerOptions(token=token)))


def _child(conn: Connection, preset: str, blocks: int, token: str | None) -> None:
    server = _start_server(preset, blocks, token)
    conn.send(server.port)
    conn.recv()  # until the parent is done
    server.close()


def _await_port(conn: Connection, child: Any, timeout_s: float = 60.0) -> int:
    """The child's server port; fails (instead of hanging) if the child dies or stalls."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if not child.is_alive():
            raise RuntimeError(f"bench server process exited with code {child.exitcode}")
        if time.monotonic() > deadline:
            child.kill()
            raise RuntimeError(f"bench server process did not start within {timeout_s:g} s")
    port: int = conn.recv()
    return port


def _time(fn: Callable[[], object], iterations: int, warmup: int, desc: str) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in progress(range(iterations), desc, total=iterations):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run(args: argparse.Namespace) -> int:
    from kvbridge.connector.control.client import ControlClient
    from kvbridge.connector.control.types import PeerInfo, Role
    from kvbridge.proto.presets import preset_layout
    from kvbridge.proto.types import EngineId

    conn: Connection | None = None
    child: Any = None
    server: Any = None
    if args.in_process:
        server = _start_server(args.preset, args.blocks, args.token)
        port = server.port
    else:
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(
            target=_child, args=(child_conn, args.preset, args.blocks, args.token), daemon=True
        )
        child.start()
        port = _await_port(conn, child)
    rows: list[dict[str, Any]] = []
    try:
        layout = preset_layout(args.preset, num_blocks=1024, order="layer-nhd")
        local = PeerInfo(EngineId("bench-decode"), Role.DECODE, layout, agent_metadata=b"y" * 512)
        hashes = {KVGroup.SELF: bench_hashes(args.blocks)}
        with ControlClient(f"127.0.0.1:{port}", token=args.token) as client:
            client.handshake(local)

            def pin_release() -> None:
                pinned = client.pin_hashes(hashes)
                assert pinned.lease_id is not None and pinned.num_blocks == args.blocks
                client.release(pinned.lease_id)

            held = client.pin_hashes(hashes)
            assert held.lease_id is not None
            lease_ids = [held.lease_id]
            ops: dict[str, tuple[Callable[[], object], int]] = {
                "Health": (client.health, 1),
                "Handshake": (lambda: client.handshake(local), 1),
                "Heartbeat": (lambda: client.heartbeat(lease_ids), 1),
                "Pin+Release": (pin_release, 2),
            }
            for name, (fn, rpcs) in ops.items():
                times = _time(fn, args.iterations, args.warmup, name)
                rows.append(
                    {
                        "operation": name,
                        "rpcs": rpcs,
                        "p50_ms": percentile(times, 50) * 1e3,
                        "p99_ms": percentile(times, 99) * 1e3,
                        "mean_ms": sum(times) / len(times) * 1e3,
                        "ops_per_s": len(times) / sum(times),
                        "rpc_per_s": rpcs * len(times) / sum(times),
                    }
                )
            client.release(held.lease_id)
    finally:
        if server is not None:
            server.close()
        if conn is not None and child is not None:
            if child.is_alive():
                conn.send("stop")
            child.join(10)
            if child.is_alive():
                child.kill()
    print_table(
        rows, ["operation", "rpcs", "p50_ms", "p99_ms", "mean_ms", "ops_per_s", "rpc_per_s"]
    )
    pin = next(r for r in rows if r["operation"] == "Pin+Release")
    verdict = "meets" if pin["p50_ms"] <= TARGET_PIN_RELEASE_P50_MS else "misses"
    where = "in-process server" if args.in_process else "server in a child process"
    target = TARGET_PIN_RELEASE_P50_MS
    print(
        f"Pin+Release of {args.blocks} blocks: p50 {pin['p50_ms']:.3f} ms, "
        f"p99 {pin['p99_ms']:.3f} ms ({verdict} the {target:g} ms p50 target; {where})"
    )
    settings = {
        "preset": args.preset,
        "blocks_per_pin": args.blocks,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "token_auth": args.token is not None,
        "server": where,
    }
    json_path, png_path = output_paths(args.out)
    path = write_json(json_path, {"settings": settings, "rows": rows})
    labels = [r["operation"] for r in rows]
    series = {
        "p50": [r["p50_ms"] for r in rows],
        "p99": [r["p99_ms"] for r in rows],
    }
    png = bar_plot(png_path, "control plane latency (loopback)", labels, series, "ms")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0

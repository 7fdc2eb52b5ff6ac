"""``kvbridge offload serve``: run the per-node CPU offload daemon until Ctrl-C/SIGTERM.

The daemon owns one NIXL agent, a host pool of ``--capacity`` bytes (allocated
and registered once, in the layout of the first authenticated worker that
connects unless ``--model`` fixes it at start) and the ``OffloadStore`` gRPC
service, which takes the control plane's ``--token`` (default
``$KVBRIDGE_TOKEN``) and ``--tls-cert``/``--tls-key``. With
``--metrics-port`` it also serves Prometheus metrics on ``/metrics``.
Defaults run on one machine: loopback, a free port, printed on start.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from kvbridge.worker.cli_checks import (
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from kvbridge.worker.kv_events import add_kv_events_arguments, kv_events_from_args, open_sink
from kvbridge.worker.run_loop import Ready, command_main, serve_until_stopped
from kvbridge.worker.server_auth import (
    add_auth_arguments,
    add_listen_arguments,
    read_auth,
    warn_if_open,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvbridge.connector.events import BlockEventSink
    from kvbridge.proto.layout import KVLayout
    from kvbridge.worker.offload.config import OffloadConfig

__all__ = [
    "add_parser",
    "check_memory",
    "check_pool_fits",
    "daemon_layout",
    "parse_bytes",
    "run",
    "main",
]

log = logging.getLogger(__name__)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str, flag: str = "--capacity") -> int:
    """``"8GiB"`` → 8589934592; accepts B, kB/KiB, MB/MiB, GB/GiB, TB/TiB (case-insensitive)."""
    from kvbridge.proto.errors import ConfigError

    if text.strip().startswith("-"):
        raise ConfigError(f"{flag} {text!r} is negative: give a size, e.g. 8GiB")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size like 8GiB, 512MiB or 1000000")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"{flag} {text!r} must be at least one byte")
    return value


def check_memory(capacity: int, text: str) -> None:
    """ConfigError unless this machine's memory (``/proc/meminfo`` MemTotal, else the
    physical pages) can hold a pool of ``capacity`` bytes."""
    from kvbridge.proto.errors import ConfigError

    total = _memory_bytes()
    if total is not None and capacity > total:
        raise ConfigError(
            f"--capacity {text} ({capacity / 2**30:.1f} GiB) is more than this machine's memory "
            f"({total / 2**30:.1f} GiB); give a smaller size, e.g. --capacity 8GiB"
        )


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``offload`` (with its ``serve`` subcommand) to the ``kvbridge`` command."""
    from kvbridge.proto.layout import ORDERS

    offload = sub.add_parser("offload", help="the per-node CPU offload daemon")
    offload_sub = offload.add_subparsers(dest="offload_command", metavar="SUBCOMMAND")
    offload_sub.required = True
    p = offload_sub.add_parser(
        "serve",
        help="run the offload daemon until Ctrl-C",
        description="Keep KV blocks in a NIXL-registered host pool keyed by prefix hash; "
        "workers store and load them over NIXL (OffloadStore gRPC service).",
    )
    p.add_argument(
        "--capacity", default="8GiB", help="host pool size, e.g. 8GiB, 512MiB (default 8GiB)"
    )
    add_listen_arguments(p, "OffloadStore gRPC port")
    p.add_argument(
        "--metrics-port",
        type=port,
        help="serve Prometheus metrics on this port (/metrics; default: off)",
    )
    p.add_argument(
        "--model",
        "--preset",
        dest="preset",
        metavar="NAME",
        help="allocate the pool at start for this model: a `kvbridge serve --model` name "
        "(tiny, small, share-tiny, encdec-tiny; with --seed) or a layout preset (llama3-8b, "
        "encdec-small, kv-share-third, kv-share-every2); default: at the first "
        "authenticated handshake, in that worker's layout",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens per block with --model (default 16)",
    )
    p.add_argument(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel size with --model (default 1)",
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="the engine's --seed with a `kvbridge serve` model (default 0)",
    )
    add_auth_arguments(p, callers="the daemon", dials=False)
    p.add_argument(
        "--max-stores-per-writer",
        type=positive_int,
        default=64,
        help="prepared, uncommitted stores one peer (one token of --token-file) may hold "
        "(default 64)",
    )
    p.add_argument(
        "--max-pinned-per-writer",
        type=positive_int,
        default=None,
        help="blocks one peer (one token of --token-file) may keep pinned by loads "
        "(default: the whole pool)",
    )
    p.add_argument(
        "--max-sessions",
        type=positive_int,
        default=256,
        help="handshake sessions kept, all peers together (a worker opens one per NIXL "
        "agent); past it the least recently used goes and its worker handshakes again "
        "(default 256)",
    )
    p.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=300.0,
        help="close client connections idle this many seconds (default 300)",
    )
    p.add_argument(
        "--order",
        help=f"pool order: one of {', '.join(ORDERS)} (default: block-outermost with the "
        "workers' inner order)",
    )
    p.add_argument(
        "--default-ttl", type=float, default=30.0, help="store/load TTL in s (default 30)"
    )
    p.add_argument(
        "--max-ttl", type=float, default=300.0, help="longest store/load TTL in s (default 300)"
    )
    p.add_argument(
        "--disk",
        metavar="PATH",
        help="a directory for a disk tier under the host pool: evicted blocks are demoted "
        "there and promoted back on loads; a restarted daemon serves what it lists",
    )
    p.add_argument(
        "--disk-capacity", default="64GiB", help="disk tier size with --disk (default 64GiB)"
    )
    add_kv_events_arguments(p, "the host pool's blocks (medium CPU; the disk tier's STORAGE)")
    p.add_argument(
        "--expired-grace",
        type=non_negative_float,
        default=60.0,
        metavar="SECONDS",
        help="keep the slots of a store that expired or aborted before its WRITE completed "
        "out of the free list this long, so a paused writer's late WRITE lands nowhere "
        "in use (default 60; readers check block digests either way)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    auth = read_auth(args)
    capacity = parse_bytes(args.capacity)
    check_memory(capacity, args.capacity)
    # the flags checked without the server's modules (they import torch: seconds): a bad
    # size, path or --model is reported at once
    disk_path = None if args.disk is None else check_disk_dir(args.disk)
    disk_capacity = parse_bytes(args.disk_capacity, "--disk-capacity")
    layout = (
        None
        if args.preset is None
        else daemon_layout(args.preset, args.block_size, args.tp_size, args.seed)
    )

    from kvbridge.connector.events import MEDIUM_CPU
    from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport
    from kvbridge.proto.layout import parse_order
    from kvbridge.worker.metrics_server import MetricsServer, MetricsServerConfig
    from kvbridge.worker.offload.metrics import offload_registry
    from kvbridge.worker.offload.pool import pool_key
    from kvbridge.worker.offload.server import OffloadConfig, new_instance, serve

    config = OffloadConfig(
        capacity_bytes=capacity,
        listen=auth.listen(args.host, args.port),
        layout=layout,
        order=None if args.order is None else parse_order(args.order),
        default_ttl_s=args.default_ttl,
        max_ttl_s=args.max_ttl,
        expired_grace_s=args.expired_grace,
        max_stores_per_writer=args.max_stores_per_writer,
        max_pinned_per_writer=args.max_pinned_per_writer,
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout,
        disk_path=disk_path,
        disk_capacity_bytes=disk_capacity,
    )
    check_pool_fits(config, args.disk_capacity)
    metrics_config = (
        None
        if args.metrics_port is None
        else MetricsServerConfig(host=args.host, port=args.metrics_port)
    )
    warn_if_open(log, args.host, auth, "store and load blocks")
    events_config = kv_events_from_args(args)

    def start(stack: ExitStack) -> Ready:
        instance = new_instance()
        publisher, events = (
            (None, None)
            if events_config is None
            else open_sink(events_config, MEDIUM_CPU, key_prefix=len(pool_key(0, b"")))
        )
        disk_events = None
        if publisher is not None:
            stack.callback(publisher.close)
            if config.disk_path is not None:
                disk_events = storage_sinks(publisher, events_config)
        transport = stack.enter_context(
            NixlTransport(NixlConfig(f"kvbridge-offload-{instance[:12]}"))
        )
        server = stack.enter_context(
            serve(transport, config, instance=instance, events=events, disk_events=disk_events)
        )
        metrics = None
        if metrics_config is not None:
            registry = offload_registry(server.handlers.snapshot)
            metrics = stack.enter_context(MetricsServer(registry, metrics_config))
        line = (
            f"kvbridge offload serve: daemon {instance} listening on {server.address}, "
            f"capacity {config.capacity_bytes} bytes"
            + (f", metrics on :{metrics.port}/metrics" if metrics else "")
            + (f", KV events on {publisher.endpoint}" if publisher else "")
        )
        return Ready(line, f"offload daemon on {server.address}")

    return serve_until_stopped(start)


def check_pool_fits(config: OffloadConfig, disk_text: str) -> None:
    """Before the pool is allocated: a one-line ConfigError unless ``--capacity`` and, with
    ``--disk``, ``--disk-capacity`` hold at least one block of the pool's layout (``--model``,
    or the one an earlier run left on the disk). Without a known layout the check waits for
    the first handshake."""
    from kvbridge.proto.errors import ConfigError
    from kvbridge.worker.offload.config import GROUP, pool_layout
    from kvbridge.worker.offload.tiered import saved_layout

    template = config.layout
    if template is None and config.disk_path is not None:
        template = saved_layout(config.disk_path)
    if template is None:
        return
    block = pool_layout(template, config).block_bytes(GROUP)  # checks --capacity
    if config.disk_path is not None and config.disk_capacity_bytes < block:
        raise ConfigError(
            f"--disk-capacity of {config.disk_capacity_bytes} bytes holds no {block}-byte "
            f"block of {template.model.name} ({disk_text}); raise --disk-capacity to at least "
            f"{block} bytes"
        )


def check_disk_dir(path: str) -> str:
    """``--disk PATH`` made if missing and checked writable, or a one-line ConfigError."""
    import os
    import tempfile

    from kvbridge.proto.errors import ConfigError

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"--disk {path!r} is not a writable directory: {exc.strerror}") from None
    return path


def storage_sinks(publisher: Any, events_config: Any) -> Callable[[int], BlockEventSink]:
    """A maker of the disk tier's event sinks (medium ``STORAGE``) on ``publisher``."""
    from kvbridge.connector.events import MEDIUM_STORAGE, KVEventSource
    from kvbridge.worker.offload.pool import pool_key

    def make(block_size: int) -> BlockEventSink:
        return KVEventSource(
            publisher,
            medium=MEDIUM_STORAGE,
            block_size=block_size,
            wire=events_config.wire,
            key_prefix=len(pool_key(0, b"")),
        )

    return make


def daemon_layout(name: str, block_size: int, tp_size: int, seed: int) -> KVLayout:
    """The pool's template layout for ``--model NAME``: a `kvbridge serve --model` name maps
    to that engine's layout (its model id includes the seed), else a layout preset."""
    from kvbridge.proto.errors import ConfigError
    from kvbridge.proto.presets import PRESETS, preset_layout
    from kvbridge.worker.engine.config import ENGINE_PRESETS, EngineConfig

    if name in ENGINE_PRESETS:
        if tp_size != 1:
            raise ConfigError(f"--tp-size {tp_size}: the reference engine ({name}) runs tp_size 1")
        return EngineConfig.preset(name, block_size=block_size, seed=seed).layout()
    if name in PRESETS:
        return preset_layout(name, block_size=block_size, tp_size=tp_size)
    names = ", ".join([*ENGINE_PRESETS, *(n for n in PRESETS if n not in ENGINE_PRESETS)])
    raise ConfigError(f"--model {name!r} is not one of {names}")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbridge.worker.offload.cmd ARGS`` (the same as ``kvbridge offload serve``)."""
    return command_main(add_parser, ["offload", "serve"], argv)


if __name__ == "__main__":
    sys.exit(main())

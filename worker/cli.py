"""The ``kvbridge`` command: one entry point, one subcommand per job.

Subcommand modules are imported only when chosen, so ``kvbridge --help``
stays fast and needs no NIXL or gRPC.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def _cmd_version(args: argparse.Namespace) -> int:
    from kvbridge.proto.version import PROTOCOL_VERSION, SCHEMA_VERSION, __version__

    print(f"kvbridge {__version__} (protocol {PROTOCOL_VERSION}, schema {SCHEMA_VERSION})")
    return 0


def _cmd_layout(args: argparse.Namespace) -> int:
    from kvbridge.proto.layout import ORDERS
    from kvbridge.proto.presets import preset_layout

    orders = args.order or ["block-nhd", "layer-nhd"]
    for i, order in enumerate(orders):
        layout = preset_layout(
            args.preset,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            order=order,
            tp_size=args.tp_size,
        )
        if i:
            print()
        print(f"[{order}]" if order in ORDERS else f"[{' '.join(layout.order)}]")
        print(layout.describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvbridge.proto.layout import ORDERS
    from kvbridge.proto.presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="KV-cache block transfer and offload for disaggregated prefill/decode.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("version", help="print the kvbridge, protocol and schema versions")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("layout", help="print a model preset's KV block byte math")
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--num-blocks", type=int, default=1024, help="blocks per group (default 1024)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument(
        "--order",
        action="append",
        help=f"physical order, repeatable: one of {', '.join(ORDERS)} or six dims "
        "like 'B L KV H N C' (default: block-nhd and layer-nhd)",
    )
    p.set_defaults(func=_cmd_layout)

    from kvbridge.worker.offload import cmd as offload_cmd
    from kvbridge.worker.serving import control_cmd, demo, node_cmd, soak

    node_cmd.add_parser(sub)
    demo.add_parser(sub)
    offload_cmd.add_parser(sub)
    control_cmd.add_parser(sub)
    soak.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print and save JSON + PNG figures")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from kvbridge.worker.bench import (
        control,
        hash,
        kernels,
        load,
        offload,
        prefill_skip,
        transfer,
        vllm,
    )

    for bench_module in (hash, transfer, kernels, control, load, offload, prefill_skip, vllm):
        bench_module.add_parser(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvbridge.proto.errors import KVBridgeError

    try:
        code: int = args.func(args)
    except KVBridgeError as exc:
        print(f"kvbridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())

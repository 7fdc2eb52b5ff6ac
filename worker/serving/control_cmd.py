"""``kvbridge serve-control``: run a bare peer control server until Ctrl-C.

The process owns an empty block pool per group of a preset layout and
answers ``Handshake``, ``Pin`` (nothing is cached, so pins come back empty),
``Heartbeat``, ``Release`` and ``Health``: enough to check a deployment's
network path, token and TLS setup, or a peer's layout compatibility, without
an engine. ``kvbridge serve`` (:mod:`kvbridge.worker.serving.node_cmd`) runs the same
control server in front of a real engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from contextlib import ExitStack

from kvbridge.worker.cli_checks import (
    add_preset_argument,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvbridge.worker.run_loop import Ready, command_main, serve_until_stopped
from kvbridge.worker.server_auth import (
    add_auth_arguments,
    add_listen_arguments,
    read_auth,
    warn_if_open,
)

__all__ = ["add_parser", "run", "main"]

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction, name: str = "serve-control") -> None:  # type: ignore[type-arg]
    from kvbridge.proto.layout import ORDERS

    p = sub.add_parser(
        name,
        help="run a bare peer control server (no engine) until Ctrl-C",
        description="Start the peer control server (gRPC) for a preset KV layout, with an "
        "empty block pool: checks addresses, tokens, TLS and layout compatibility.",
    )
    add_preset_argument(p, "model whose KV layout the pool has", "tiny")
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per block (default 16)"
    )
    p.add_argument(
        "--num-blocks", type=positive_int, default=1024, help="blocks per group (default 1024)"
    )
    p.add_argument(
        "--order",
        default="block-nhd",
        help=f"physical order: {', '.join(ORDERS)} (default block-nhd)",
    )
    p.add_argument(
        "--tp-rank", type=non_negative_int, default=0, help="this rank, below --tp-size (default 0)"
    )
    p.add_argument(
        "--tp-size",
        type=positive_int,
        default=1,
        help="tensor-parallel size; divides the model's KV heads (default 1)",
    )
    p.add_argument(
        "--role",
        default="prefill",
        choices=["prefill", "decode", "both", "offload"],
        help="the role peers see in the handshake (default prefill)",
    )
    p.add_argument("--engine-id", help="unique id of this process (default: HOST-PID)")
    add_listen_arguments(p, "PeerControl port")
    add_auth_arguments(p, callers="the control port", dials=False)
    p.add_argument(
        "--default-ttl", type=positive_float, default=30.0, help="lease TTL in s (default 30)"
    )
    p.add_argument(
        "--max-ttl", type=positive_float, default=600.0, help="longest lease TTL in s (default 600)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.connector.control.server import ControlServerConfig, serve
    from kvbridge.connector.control.types import PeerInfo, Role
    from kvbridge.proto.presets import preset_layout
    from kvbridge.proto.types import EngineId
    from kvbridge.worker.block_pool import BlockPool
    from kvbridge.worker.pool_owner import PoolBlockOwner

    layout = preset_layout(
        args.preset,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        order=args.order,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
    )
    auth = read_auth(args)
    warn_if_open(log, args.host, auth, "pin blocks and read their layout")
    config = ControlServerConfig(
        listen=auth.listen(args.host, args.port),
        default_ttl_s=args.default_ttl,
        max_ttl_s=args.max_ttl,
    )
    engine_id = EngineId(args.engine_id or f"{socket.gethostname()}-{os.getpid()}")
    owner = PoolBlockOwner({g.name: BlockPool(g.num_blocks) for g in layout.groups})
    local = PeerInfo(engine_id, Role(args.role), layout)

    def start(stack: ExitStack) -> Ready:
        server = stack.enter_context(serve(local, owner, config))
        line = (
            f"kvbridge serve-control: {engine_id} ({args.role}, {args.preset}, "
            f"{' '.join(layout.order)}) listening on {server.address}"
            + (" with TLS" if config.listen.tls else "")
            + (" with token auth" if auth.token else "")
        )
        return Ready(line, f"control server on {server.address}")

    return serve_until_stopped(start)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbridge.worker.serving.control_cmd``: the same as ``kvbridge serve-control``."""
    return command_main(add_parser, ["serve-control"], argv)


if __name__ == "__main__":
    sys.exit(main())

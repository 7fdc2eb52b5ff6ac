"""``kvbridge serve``: run one prefill, decode or combined serving node until stopped."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from contextlib import ExitStack
from pathlib import Path

from kvbridge.proto.layout import ORDERS
from kvbridge.worker.cli_checks import (
    add_on_load_error,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from kvbridge.worker.kv_events import add_kv_events_arguments, kv_events_from_args
from kvbridge.worker.run_loop import Ready, serve_until_stopped
from kvbridge.worker.server_auth import (
    add_auth_arguments,
    add_listen_arguments,
    read_auth,
    warn_if_open,
)

__all__ = [
    "add_parser",
    "run",
    "add_engine_arguments",
    "engine_config_from_args",
    "engine_model_flags",
    "add_security_arguments",
    "check_device",
]

log = logging.getLogger(__name__)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Model and KV layout flags, shared by ``serve`` and ``demo``."""
    p.add_argument(
        "--model",
        "--preset",
        dest="model",
        default="tiny",
        help="reference engine model: tiny, small, share-tiny (8 layers, last 4 share KV) "
        "or encdec-tiny (default tiny)",
    )
    p.add_argument(
        "--order",
        default="block-nhd",
        choices=sorted(ORDERS),
        help="physical KV layout order (default block-nhd: block-outermost)",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)"
    )
    p.add_argument(
        "--num-blocks", type=positive_int, default=512, help="KV blocks per worker (default 512)"
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="weight seed; must match on every node (default 0)",
    )
    p.add_argument(
        "--share-last",
        type=int,
        default=None,
        metavar="N",
        help="KV sharing: the last N layers reuse the KV of the layers N before them",
    )
    p.add_argument(
        "--share-every",
        type=int,
        default=None,
        metavar="M",
        help="KV sharing: every M-th layer reuses the previous layer's KV",
    )
    p.add_argument(
        "--prefill-skip",
        action="store_true",
        help="trailing KV-sharing layers compute only each prompt's last token in prefill",
    )
    p.add_argument(
        "--encoder-decoder",
        action="store_true",
        help="add an encoder and cross-attention KV (requests then carry encoder input)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device of the model and its KV cache: cpu (default), cuda or cuda:N "
        "(KV blocks then move over NIXL from and to VRAM)",
    )


def engine_config_from_args(args: argparse.Namespace, order: str | None = None) -> object:
    from kvbridge.proto.errors import ConfigError
    from kvbridge.worker.engine import EngineConfig

    check_device(getattr(args, "device", "cpu"))
    overrides: dict[str, object] = {}
    share_last = getattr(args, "share_last", None)
    share_every = getattr(args, "share_every", None)
    if share_last is not None or share_every is not None:  # a pattern given replaces the preset's
        overrides.update(share_last=share_last or 0, share_every=share_every or 0)
    if getattr(args, "prefill_skip", False):
        overrides["prefill_skip"] = True
    if getattr(args, "encoder_decoder", False):
        overrides["encoder_decoder"] = True
    try:
        return EngineConfig.preset(
            args.model,
            order=order or args.order,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            seed=args.seed,
            **overrides,
        )
    except ConfigError as exc:  # name the flags the user typed, not EngineConfig's fields
        raise ConfigError(_flag_names(str(exc))) from None


def check_device(device: str) -> None:
    """ConfigError naming ``--device`` unless this machine's torch can use ``device``."""
    from kvbridge.proto.errors import ConfigError

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"--device {device!r} must be cpu, cuda or cuda:N")
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = f"{count} CUDA device(s)" if count else "no CUDA device"
        raise ConfigError(
            f"--device {device}: this torch ({torch.__version__}) sees {seen}; use --device "
            "cpu, or a CUDA build of torch on a machine with a GPU"
        )


_FLAGS = ("block_size", "num_blocks", "seed", "share_last", "share_every", "order")


def _flag_names(message: str) -> str:
    """``EngineConfig.share_last=3 ...`` as ``--share-last 3 ...`` for the fields with flags."""
    for name in _FLAGS:
        flag = "--" + name.replace("_", "-")
        message = re.sub(rf"\b(?:EngineConfig\.)?{name}=", f"{flag} ", message)
        message = re.sub(rf"\bEngineConfig\.{name}\b", flag, message)
    message = message.replace("EngineConfig: ", "").replace("EngineConfig.", "")
    return re.sub(r"^model (?=')", "--model ", message)  # EngineConfig.preset's unknown name


def engine_model_flags(args: argparse.Namespace) -> list[str]:
    """The KV-sharing, prefill-skip, encoder-decoder and device flags of ``args`` as a command line,
    so a parent (``demo``) starts ``serve`` children with the same model."""
    flags: list[str] = []
    for name in ("share_last", "share_every"):
        value = getattr(args, name, None)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    for name in ("prefill_skip", "encoder_decoder"):
        if getattr(args, name, False):
            flags.append(f"--{name.replace('_', '-')}")
    device = getattr(args, "device", "cpu")
    if device != "cpu":
        flags += ["--device", device]
    return flags


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    """Token, TLS and peer allowlist flags of ``serve`` (README "Security")."""
    add_auth_arguments(p, callers="the Inference and control ports", dials=True)
    p.add_argument(
        "--allow-peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a prefill control address decode may dial (repeatable); default: loopback "
        "addresses only. A request naming any other address is recomputed, never dialed",
    )


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "serve",
        help="run a prefill/decode serving node (engine + kvbridge connector + servers)",
        description="Run one serving node: the reference engine with kvbridge's connector, a "
        "PeerControl server for peers and an Inference server for the router.",
    )
    p.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        default="both",
        help="prefill hands its prompts' KV to decode nodes, decode loads it, both (default) "
        "does either",
    )
    p.add_argument("--engine-id", default=None, help="unique engine id (default: role-pid)")
    add_engine_arguments(p)
    add_listen_arguments(p, "Inference port")
    p.add_argument(
        "--control-port", type=port, default=0, help="PeerControl port (default 0: pick a free one)"
    )
    p.add_argument(
        "--advertise",
        default="",
        metavar="HOST:PORT",
        help="host:port peers use for PeerControl (default: the listening address)",
    )
    add_security_arguments(p)
    p.add_argument(
        "--lease-ttl",
        type=positive_float,
        default=30.0,
        help="seconds a pin lives unheartbeaten (default 30)",
    )
    p.add_argument(
        "--max-lease-ttl",
        type=positive_float,
        default=600.0,
        help="longest lease a peer may ask for; longer requests are clamped (default 600 s)",
    )
    p.add_argument(
        "--load-timeout",
        type=positive_float,
        default=10.0,
        help="deadline of one KV load in s (default 10)",
    )
    p.add_argument(
        "--stall-before-read",
        type=non_negative_float,
        default=0.0,
        help="test hook: decode sleeps this long before each READ (default 0)",
    )
    add_on_load_error(p)
    p.add_argument(
        "--no-verify-loads",
        dest="verify_loads",
        action="store_false",
        help="do not digest handed-over blocks (prefill) nor check loaded blocks against their "
        "digests (decode); default: verify (a peer that WRITEs this node's NIXL memory could "
        "otherwise change decoded tokens)",
    )
    p.add_argument(
        "--offload",
        default="",
        metavar="HOST:PORT",
        help="this node's CPU offload daemon (kvbridge offload serve); default: none",
    )
    p.add_argument(
        "--no-offload-verify",
        action="store_true",
        help="trust the offload daemon's memory: skip the digest check of every block loaded "
        "from it (faster loads; a late or hostile WRITE into the daemon then goes unnoticed)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="serve Prometheus transfer metrics on this port at /metrics (0: any free port; "
        "default: off)",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write {inference, control} addresses as JSON here once serving",
    )
    add_kv_events_arguments(p, "the prefix cache's blocks (medium GPU)")
    p.set_defaults(func=run)


_FIELD_FLAGS = {
    "OffloadLookupConfig.address": "--offload",
    "OffloadClientConfig.address": "--offload",
    "allowed_peers": "--allow-peer",
    "max_lease_ttl_s": "--max-lease-ttl",
    "lease_ttl_s": "--lease-ttl",
    "load_timeout_s": "--load-timeout",
    "stall_before_read_s": "--stall-before-read",
}
"""Config fields named in errors -> the flag that sets them (longest names first)."""


def run(args: argparse.Namespace) -> int:
    from kvbridge.proto.errors import ConfigError

    try:
        return _run(args)
    except ConfigError as exc:  # name the flag the user typed, not the config field
        message = str(exc)
        for name, flag in _FIELD_FLAGS.items():
            message = re.sub(rf"(?<![\w-]){re.escape(name)}\b", flag, message)
        if message == str(exc):
            raise
        raise ConfigError(message) from None


def _check_address(flag: str, address: str, what: str) -> None:
    """ConfigError naming ``flag`` unless ``address`` (when given) is ``HOST:PORT``."""
    from kvbridge.connector.addresses import normalize_address
    from kvbridge.proto.errors import ConfigError

    if not address:
        return
    try:
        normalize_address(address)
    except ValueError:
        raise ConfigError(
            f"{flag} {address!r} must be HOST:PORT with a port from 1 to 65535 ({what})"
        ) from None


def _run(args: argparse.Namespace) -> int:
    from kvbridge.connector.config import ConnectorConfig

    engine_id = args.engine_id or f"{args.role}-{os.getpid()}"
    if args.role != "decode" and not args.advertise and args.host in ("0.0.0.0", "::", ""):
        from kvbridge.proto.errors import ConfigError

        raise ConfigError(
            f"--host {args.host or '(empty)'} listens on every interface, but peers cannot dial "
            "that address: pass --advertise HOST:PORT (this node's reachable address and its "
            "--control-port) so decode nodes can reach its control server"
        )
    _check_address(
        "--advertise", args.advertise, "this node's reachable address and its --control-port"
    )
    _check_address("--offload", args.offload, "the address kvbridge offload serve listens on")
    security = read_auth(args)
    warn_if_open(log, args.host, security, "generate, pin blocks and read KV")
    engine = engine_config_from_args(args)
    connector = ConnectorConfig(
        engine_id=engine_id,
        role=args.role,
        control_address=args.advertise,
        token=security.token,
        tls_root_cert=security.tls_root_cert,
        allowed_peers=tuple(args.allow_peer),
        lease_ttl_s=args.lease_ttl,
        max_lease_ttl_s=args.max_lease_ttl,
        load_timeout_s=args.load_timeout,
        stall_before_read_s=args.stall_before_read,
        on_load_error=args.on_load_error,
        offload_address=args.offload,
        offload_verify=not args.no_offload_verify,
        verify_loads=args.verify_loads,
    )
    kv_events = kv_events_from_args(args)
    # the flags are checked: only now the modules that take seconds (torch, NIXL, gRPC)
    import torch

    from kvbridge.worker.metrics_server import MetricsServer, MetricsServerConfig
    from kvbridge.worker.serving.node import Node, NodeConfig

    torch.set_num_threads(args.threads)
    config = NodeConfig(
        engine=engine,  # type: ignore[arg-type]
        connector=connector,
        listen=security.listen(args.host, args.port),
        device=args.device,
        control_port=args.control_port,
        kv_events=kv_events,
    )
    metrics_config = (
        None
        if args.metrics_port is None
        else MetricsServerConfig(host=args.host, port=args.metrics_port)
    )

    def start(stack: ExitStack) -> Ready:
        node = stack.enter_context(Node(config))
        ready = {"inference": node.address, "control": node.control.address, "engine_id": engine_id}
        if metrics_config is not None:
            metrics = stack.enter_context(MetricsServer(node.metrics.registry, metrics_config))
            ready["metrics"] = metrics.url
        if node.kv_events is not None:
            ready["kv_events"] = node.kv_events.endpoint
        return Ready(json.dumps(ready), engine_id)

    return serve_until_stopped(start, ready_file=args.ready_file)

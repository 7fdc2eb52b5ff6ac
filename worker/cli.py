"""The ``kvbridge`` command: one entry point, one subcommand per job.

Subcommand modules are imported only when chosen, so ``kvbridge --help``
stays fast and needs no NIXL or gRPC. A failure caused by the user's input or
environment (a bad flag, a missing or non-PEM file, a port in use, too little
memory) ends with one line naming the flag and exit status 2; ``-v`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from kvbridge.worker.cli_checks import (
    add_preset_argument,
    merge_negative_values,
    plain_text,
    positive_int,
    preflight,
    quiet_libraries,
)

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


class _Parser(argparse.ArgumentParser):
    """Errors in two lines: what is wrong, and where the flags are listed (argparse would
    print the whole usage first). Subcommand parsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvbridge.proto.layout import ORDERS
    from kvbridge.proto.version import PROTOCOL_VERSION, SCHEMA_VERSION, __version__

    parser = _Parser(
        prog="kvbridge",
        description="KV-cache block transfer and offload for disaggregated prefill/decode.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more logging: INFO (kvbridge, NIXL, gRPC) and tracebacks of errors; -vv: debug",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvbridge {__version__} (protocol {PROTOCOL_VERSION}, schema {SCHEMA_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("version", help="print the kvbridge, protocol and schema versions")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("layout", help="print a model's KV block byte math")
    add_preset_argument(p, "model name", "llama3-8b")
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per block (default 16)"
    )
    p.add_argument(
        "--num-blocks", type=positive_int, default=1024, help="blocks per group (default 1024)"
    )
    p.add_argument(
        "--tp-size", type=positive_int, default=1, help="tensor-parallel size (default 1)"
    )
    p.add_argument(
        "--order",
        action="append",
        help=f"physical order, repeatable: one of {', '.join(ORDERS)} or six dims "
        "like 'B L KV H N C' (default: block-nhd and layer-nhd)",
    )
    p.set_defaults(func=_cmd_layout)

    from kvbridge.worker.offload import cmd as offload_cmd
    from kvbridge.worker.serving import control_cmd, node_cmd
    from kvbridge.worker.tools import demo, soak

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
    _plain_help(parser)
    return parser


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Strip reStructuredText markup from every description and help text (many
    descriptions are module docstrings)."""
    parser.description = plain_text(parser.description)
    for action in parser._actions:
        action.help = plain_text(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain_text(choice.help)
            for sub in set(action.choices.values()):
                _plain_help(sub)


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command the user chose."""
    for dest in ("command", "offload_command", "bench"):
        name = getattr(args, dest, None)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not name or not subs or name not in subs[0].choices:
            continue
        parser = subs[0].choices[name]
    return parser


def _program(args: argparse.Namespace) -> str:
    """The command line's program as the user typed it: ``kvbridge offload serve``."""
    words = ["kvbridge", args.command]
    for dest in ("offload_command", "bench"):
        if getattr(args, dest, None):
            words.append(getattr(args, dest))
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> int:
    argv = merge_negative_values(sys.argv[1:] if argv is None else argv)
    verbose = sum(a.count("v") for a in argv if a.startswith("-") and set(a[1:]) == {"v"})
    verbose += argv.count("--verbose")
    quiet_libraries(verbose)  # before anything imports NIXL or gRPC
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand the user typed, not by "kvbridge"
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvbridge.proto.errors import KVBridgeError

    program = _program(args)
    problem = preflight(args)
    if problem is not None:
        print(f"{program}: error: {problem}", file=sys.stderr)
        return 2
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not in a message at exit
    except KeyboardInterrupt:
        return 130
    except (KVBridgeError, OSError, MemoryError, RuntimeError) as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_reader_gone():
            return 141  # `kvbridge layout | head`: quiet, as a process SIGPIPE ends
        message = _user_error(exc)
        if message is None:
            raise
        if args.verbose:
            traceback.print_exc()
        message = _with_flag_names(message, _chosen(parser, args))
        print(f"{program}: error: {message}", file=sys.stderr)
        return 2
    return code


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it; if so, stdout goes to /dev/null so
    that nothing more is written there (Python's flush at exit included)."""
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
        if gone:
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        return gone
    except (AttributeError, ValueError, OSError):
        return False


def _with_flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """A config field named in an error (``tp_size 3``) as the flag of this command that sets
    it (``--tp-size 3``): only fields whose name has an underscore (never an English word),
    never after a ``.`` (``OffloadLookupConfig.tp_size`` is another object's field)."""
    import re

    for action in parser._actions:
        flag = "--" + action.dest.replace("_", "-")  # not --no-verify-loads for verify_loads
        if "_" in action.dest and flag in action.option_strings:
            message = re.sub(rf"(?<![\w.-]){action.dest}(?!\w)", flag, message)
    return message


def _user_error(exc: BaseException) -> str | None:
    """The one-line message for an error the user's input or environment caused; None for
    anything else (a bug: its traceback is shown)."""
    from kvbridge.proto.errors import KVBridgeError

    if isinstance(exc, KVBridgeError):
        return str(exc)
    if isinstance(exc, MemoryError):
        return "out of memory; ask for less (--capacity, --num-blocks) or free memory"
    if isinstance(exc, OSError):
        where = f" {exc.filename!r}" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    text = str(exc)
    if text.startswith("Failed to bind to address"):
        address = text.removeprefix("Failed to bind to address ").split(";")[0]
        return (
            f"cannot listen on {address}: the address is in use or not local, or the TLS "
            "certificate and key do not match (check --host, the ports, --tls-cert/--tls-key)"
        )
    if "can't allocate memory" in text or "Cannot allocate memory" in text:
        return "out of memory; ask for less (--capacity, --num-blocks) or free memory"
    return None


if __name__ == "__main__":
    sys.exit(main())

"""What every ``kvbridge`` command checks before it starts anything, and how it says no.

Argument types (:func:`positive_int`, :func:`positive_float`, :func:`port`, ...) make
argparse refuse a bad number with the flag's name; :func:`preflight` checks the files and ports a
command was given (token and TLS files readable and PEM where they must be,
ports free on ``--host``) before NIXL or gRPC start, so the user reads one
line naming the flag instead of a library's traceback or its misleading
"Failed to bind". :func:`quiet_libraries` sets NIXL's and gRPC's log levels
from ``-v`` before either is imported. Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "add_on_load_error",
    "add_preset_argument",
    "fixed_port",
    "int_at_least",
    "merge_negative_values",
    "non_negative_float",
    "non_negative_int",
    "plain_text",
    "port",
    "positive_float",
    "positive_int",
    "preflight",
    "quiet_libraries",
]


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def check(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {minimum}")
        return value

    return check


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, sizes in MiB)."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def port(text: str) -> int:
    """An argparse type: a TCP port, 0 (pick a free one) to 65535."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 picks a free one, max 65535)")
    return value


def fixed_port(text: str) -> int:
    """An argparse type: a TCP port a command hands on to processes it starts, 1024 to 65535
    (no 0: those processes need the number before they listen)."""
    value = _int(text)
    if not 1024 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port it can use: give one from 1024 to 65535 "
            "(0 does not apply: the engines are told their ports before they start)"
        )
    return value


def add_on_load_error(p: argparse.ArgumentParser) -> None:
    """``--on-load-error``: what a serving node does with a request whose KV load failed
    (``serve``, and ``demo`` and ``soak``, which pass it on to the nodes they start)."""
    from kvbridge.connector.config import LOAD_ERROR_POLICIES

    p.add_argument(
        "--on-load-error",
        choices=LOAD_ERROR_POLICIES,
        default="recompute",
        help="a request whose KV load failed: recompute what did not arrive (default) or fail",
    )


def add_preset_argument(p: argparse.ArgumentParser, what: str, default: str) -> None:
    """``--model``/``--preset`` (``args.preset``): one of the layout presets, the models
    kvbridge knows the KV shape of without weights; ``what`` is the help text's start."""
    from kvbridge.proto.presets import PRESETS

    p.add_argument(
        "--model",
        "--preset",
        dest="preset",
        default=default,
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"{what}: {', '.join(sorted(PRESETS))} (default {default})",
    )


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def merge_negative_values(argv: Sequence[str]) -> list[str]:
    """``--capacity -5GiB`` as ``--capacity=-5GiB``: argparse takes a value that starts with
    ``-`` and a digit but is not a plain number for an option and fails with "expected one
    argument"; joined, the option's own check names what is wrong with the value."""
    out: list[str] = []
    for token in argv:
        if (
            out
            and re.match(r"-\d", token)
            and not re.fullmatch(r"-\d+(\.\d*)?", token)
            and out[-1].startswith("--")
            and "=" not in out[-1]
            and out[-1] != "--"
        ):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


_LIB_LEVELS = {0: ("WARN", "ERROR"), 1: ("INFO", "INFO"), 2: ("DEBUG", "DEBUG")}


def quiet_libraries(verbose: int) -> None:
    """NIXL's (``NIXL_LOG_LEVEL``) and gRPC's (``GRPC_VERBOSITY``) log levels: warnings only
    by default, INFO with ``-v``, DEBUG with ``-vv``; a value the user set wins. Child
    processes (``demo``'s nodes) inherit them."""
    nixl, grpc = _LIB_LEVELS[min(verbose, 2)]
    os.environ.setdefault("NIXL_LOG_LEVEL", nixl)
    os.environ.setdefault("GRPC_VERBOSITY", grpc)


_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`")


def plain_text(text: str | None) -> str | None:
    """A docstring or help text without reStructuredText markup (````x````, ``:mod:`a.b```)."""
    if text is None:
        return None
    text = _ROLE.sub(r"\1", text)
    return text.replace("``", "").replace("`", "")


_PORT_FLAGS = ("port", "control_port", "metrics_port")
_PEM = {
    "tls_cert": b"-----BEGIN CERTIFICATE-----",
    "tls_ca": b"-----BEGIN CERTIFICATE-----",
    "tls_key": b"PRIVATE KEY-----",
}


def preflight(args: argparse.Namespace) -> str | None:
    """The first problem with the files and ports in ``args`` as one message, or None."""
    for dest in ("token_file", *_PEM):
        path = getattr(args, dest, None)
        if not isinstance(path, Path):
            continue
        flag = _flag(dest)
        try:
            data = path.read_bytes()
        except OSError as exc:
            return f"{flag} {str(path)!r}: {exc.strerror or exc}; pass a readable file"
        if dest in _PEM and _PEM[dest] not in data:
            kind = "private key" if dest == "tls_key" else "certificate"
            return (
                f"{flag} {str(path)!r} is not a PEM {kind} (no '{_PEM[dest].decode()}' line); "
                f"pass the PEM file of the {kind}"
            )
    problem = _tls_problem(args)
    if problem:
        return problem
    host = getattr(args, "host", None) or "127.0.0.1"
    ports = [(d, getattr(args, d)) for d in _PORT_FLAGS if isinstance(getattr(args, d, None), int)]
    for dest, value in ports:
        problem = _port_problem(host, value)
        if problem:
            return problem if value == 0 else f"{_flag(dest)} {value}: {problem}"
    return None


def _tls_problem(args: argparse.Namespace) -> str | None:
    """Whether the PEM files load as OpenSSL will load them: the certificate with its key,
    the roots as roots (gRPC would only say "Failed to bind")."""
    import ssl

    cert, key, ca = (getattr(args, d, None) for d in ("tls_cert", "tls_key", "tls_ca"))
    if isinstance(cert, Path) and isinstance(key, Path):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            return (
                f"--tls-cert {str(cert)!r} with --tls-key {str(key)!r} does not load "
                f"({exc.reason or exc}); pass a PEM certificate and the private key it was made for"
            )
    if isinstance(ca, Path):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(ca))
        except ssl.SSLError as exc:
            return f"--tls-ca {str(ca)!r} holds no usable PEM certificate ({exc.reason or exc})"
    return None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _port_problem(host: str, value: int) -> str | None:
    """Why ``host:value`` cannot be listened on, or None (a plain bind, closed at once)."""
    try:
        infos = socket.getaddrinfo(host, value, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"--host {host!r} does not resolve ({exc.strerror}); pass an address of this machine"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"{host}:{value} is already in use; stop what listens there or choose "
                    "another port (0 picks a free one)"
                )
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"--host {host!r} is not an address of this machine"
            if exc.errno == errno.EACCES:
                return f"no permission to listen on {host}:{value}; choose a port above 1023"
            return f"cannot listen on {host}:{value}: {exc.strerror}; check --host and the port"
    return None

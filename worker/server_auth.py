"""The token and TLS flags every kvbridge server command takes, read one way.

``kvbridge serve`` (a serving node) and ``kvbridge offload serve`` (the CPU
offload daemon) both listen on gRPC ports that hand out or accept KV blocks, so
both take the same ``--token`` / ``--token-file`` / ``$KVBRIDGE_TOKEN`` and
``--tls-cert`` / ``--tls-key`` flags (README "Security"), read files the same
way (a missing file is a :class:`ConfigError` naming the flag), warn the same
way when they listen beyond loopback without a token, and refuse the same way
to send a token in plaintext beyond loopback unless ``--insecure-plaintext-token``
says the operator accepts it. Nothing heavy is imported here: ``kvbridge
--help`` builds these parsers.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ServerAuth",
    "add_auth_arguments",
    "add_plaintext_argument",
    "read_auth",
    "warn_if_open",
]


@dataclass(frozen=True, slots=True)
class ServerAuth:
    """What the token and TLS flags say, files read."""

    token: str | None
    tls_cert: bytes | None
    tls_key: bytes | None
    tls_root_cert: bytes | None
    """Roots a peer's certificate must chain to when this process dials out over TLS
    (``--tls-ca``, default ``--tls-cert``); None for servers that never dial."""
    insecure_plaintext_token: bool = False
    """``--insecure-plaintext-token``: a token may travel without TLS beyond loopback."""


def add_auth_arguments(p: argparse.ArgumentParser, *, callers: str, dials: bool) -> None:
    """``--token``/``--token-file`` (one of them), ``--tls-cert``, ``--tls-key`` and, when the
    command also dials peers (``dials``), ``--tls-ca``. ``callers`` names who must send the
    token, for the help text."""
    auth = p.add_mutually_exclusive_group()
    auth.add_argument(
        "--token",
        default=os.environ.get("KVBRIDGE_TOKEN"),
        help=f"shared token every caller of {callers} must send"
        + (", and that this node sends to allowed peers" if dials else "")
        + " (default: $KVBRIDGE_TOKEN; none)",
    )
    auth.add_argument("--token-file", type=Path, help="read the shared token from this file")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve TLS only")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    add_plaintext_argument(p)
    if dials:
        p.add_argument(
            "--tls-ca",
            type=Path,
            help="PEM roots peers' control certificates must chain to; dials peers over TLS "
            "(default with --tls-cert: that certificate)",
        )


def add_plaintext_argument(p: argparse.ArgumentParser) -> None:
    """``--insecure-plaintext-token``: without it a token on a non-loopback host needs TLS."""
    p.add_argument(
        "--insecure-plaintext-token",
        action="store_true",
        help="allow a token without TLS on a non-loopback --host: anyone on the network "
        "path can read it (default: refuse to start; use --tls-cert/--tls-key)",
    )


def read_auth(args: argparse.Namespace) -> ServerAuth:
    """The token (``--token``, ``--token-file``, ``$KVBRIDGE_TOKEN``) and the TLS files."""
    from kvbridge.proto.errors import ConfigError

    token = args.token
    if args.token_file is not None:
        token = _read_token(args.token_file)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    cert = None if args.tls_cert is None else _read(args.tls_cert, "--tls-cert")
    ca = getattr(args, "tls_ca", None)
    # a server that never dials (no --tls-ca flag) trusts no roots; the node trusts its own
    # certificate unless --tls-ca names other roots
    roots = cert if ca is None else _read(ca, "--tls-ca")
    if not hasattr(args, "tls_ca"):
        roots = None
    return ServerAuth(
        token=token or None,
        tls_cert=cert,
        tls_key=None if args.tls_key is None else _read(args.tls_key, "--tls-key"),
        tls_root_cert=roots,
        insecure_plaintext_token=bool(getattr(args, "insecure_plaintext_token", False)),
    )


def warn_if_open(log: logging.Logger, host: str, auth: ServerAuth, exposes: str) -> None:
    """Warn once at start when ``host`` is not loopback and no token guards the ports;
    ConfigError when a token would travel there in plaintext and the operator did not
    pass ``--insecure-plaintext-token``."""
    from kvbridge.connector.control.peers import is_loopback, refuse_plaintext_token

    refuse_plaintext_token(
        host,
        token=auth.token is not None,
        tls=auth.tls_cert is not None,
        accepted=auth.insecure_plaintext_token,
        flag="--insecure-plaintext-token",
        tls_flags="--tls-cert/--tls-key",
    )
    if auth.token is None and not is_loopback(f"{host}:0"):
        log.warning(
            "listening on %s without a token: anyone who reaches the port may %s; "
            "set --token or $KVBRIDGE_TOKEN",
            host,
            exposes,
        )


def _read_token(path: Path) -> str:
    """The token in ``path``, stripped; ConfigError if the file names none (an empty
    file must not leave the server open) or is not UTF-8."""
    from kvbridge.proto.errors import ConfigError

    try:
        token = _read(path, "--token-file").decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"--token-file {str(path)!r} is not UTF-8 text") from None
    if not token:
        raise ConfigError(
            f"--token-file {str(path)!r} is empty: write the token into it, or leave the "
            "flag out to run without one"
        )
    return token


def _read(path: Path, flag: str) -> bytes:
    from kvbridge.proto.errors import ConfigError

    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r}: {exc.strerror}") from None

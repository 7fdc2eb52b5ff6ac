"""The token and TLS flags every kvbridge server command takes, read one way.

``kvbridge serve`` (a serving node) and ``kvbridge offload serve`` (the CPU
offload daemon) both listen on gRPC ports that hand out or accept KV blocks, so
both take the same ``--token`` / ``--token-file`` / ``$KVBRIDGE_TOKEN`` (a token
file may list several tokens, one per peer, for per-peer bounds) and
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
from typing import TYPE_CHECKING

from kvbridge.worker.cli_checks import port

if TYPE_CHECKING:
    from kvbridge.connector.server_options import ServerOptions

__all__ = [
    "ServerAuth",
    "add_auth_arguments",
    "add_listen_arguments",
    "add_plaintext_argument",
    "check_token",
    "read_auth",
    "read_token_file",
    "warn_if_open",
]


@dataclass(frozen=True, slots=True)
class ServerAuth:
    """What the token and TLS flags say, files read."""

    token: str | None
    """The token, or a :class:`~kvbridge.connector.control.auth.TokenSet` from a token file
    with several (servers accept each; as a string it is the first, the one sent)."""
    tls_cert: bytes | None
    tls_key: bytes | None
    tls_root_cert: bytes | None
    """Roots a peer's certificate must chain to when this process dials out over TLS
    (``--tls-ca``, default ``--tls-cert``); None for servers that never dial."""
    insecure_plaintext_token: bool = False
    """``--insecure-plaintext-token``: a token may travel without TLS beyond loopback."""

    def listen(self, host: str, port: int, port_flag: str = "--port") -> ServerOptions:
        """A server's options on ``host:port`` with this token and TLS pair."""
        from kvbridge.connector.server_options import ServerOptions

        return ServerOptions(host, port, self.token, self.tls_cert, self.tls_key, port_flag)


def add_listen_arguments(p: argparse.ArgumentParser, port_name: str) -> None:
    """``--host`` (default loopback) and ``--port`` (default 0: a free one, printed on start);
    ``port_name`` says which port ``--port`` is, for the help text."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=port, default=0, help=f"{port_name} (default 0: pick a free one)")


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
    auth.add_argument(
        "--token-file",
        type=Path,
        help="read the token from this file; several tokens, one a line (blank lines and "
        "# comments ignored), are each accepted as a separate peer with its own caps"
        + ("; the first is the one this node sends to peers" if dials else ""),
    )
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
        token = read_token_file(args.token_file)
    elif token is not None:
        check_token(token, from_env=token == os.environ.get("KVBRIDGE_TOKEN"))
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


def check_token(token: str, *, from_env: bool = False) -> None:
    """ConfigError naming ``--token`` (or ``$KVBRIDGE_TOKEN``) unless ``token`` can be a
    token: not empty (an empty one would leave the ports open while the operator believes
    them guarded), no spaces at its ends (a token file's line is stripped, so peers reading
    the same token from a file would not match), printable ASCII (it travels as metadata)."""
    from kvbridge.proto.errors import ConfigError

    where = "$KVBRIDGE_TOKEN" if from_env else "--token"
    if not token.strip():
        raise ConfigError(
            f"{where} is empty: give the token, or leave it out to run without one"
            + (" (unset $KVBRIDGE_TOKEN)" if from_env else "")
        )
    if token != token.strip():
        raise ConfigError(
            f"{where} has spaces at its start or end: remove them (a --token-file line is "
            "stripped, so a peer reading the same token from a file would not match)"
        )
    if not (token.isascii() and token.isprintable()):
        raise ConfigError(f"{where}: a token must be printable ASCII (it travels as gRPC metadata)")


def warn_if_open(log: logging.Logger, host: str, auth: ServerAuth, exposes: str) -> None:
    """Warn once at start when ``host`` is not loopback and no token guards the ports;
    ConfigError when a token would travel there in plaintext and the operator did not
    pass ``--insecure-plaintext-token``."""
    from kvbridge.connector.addresses import is_loopback
    from kvbridge.connector.control.peers import refuse_plaintext_token

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


def read_token_file(path: Path, flag: str = "--token-file") -> str:
    """The tokens in ``path``, one a line (stripped; blank lines and lines starting with
    ``#`` ignored): one token as a plain string, several as a
    :class:`~kvbridge.connector.control.auth.TokenSet` (each accepted, each its own peer;
    the first is what this process sends when it dials peers). ConfigError naming ``flag``
    if the file names none (an empty file must not leave the server open), is not UTF-8,
    or holds a token that cannot travel as metadata."""
    from kvbridge.connector.control.auth import TokenSet
    from kvbridge.proto.errors import ConfigError

    where = f"{flag} {str(path)!r}"
    try:
        lines = _read(path, flag).decode().splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    tokens = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if not (token.isascii() and token.isprintable()):
            raise ConfigError(
                f"{where} line {number}: a token must be printable ASCII (it travels as "
                "gRPC metadata)"
            )
        tokens.append(token)
    if not tokens:
        raise ConfigError(
            f"{where} is empty (no token line): write the token into it, or leave the "
            "flag out to run without one"
        )
    _warn_if_others_can_read(path, where)
    return tokens[0] if len(tokens) == 1 else TokenSet(tokens)


def _warn_if_others_can_read(path: Path, where: str) -> None:
    """One warning when users other than the owner may read or write the token file."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return
    if mode & 0o077:
        logging.getLogger(__name__).warning(
            "%s can be read by other users (mode %04o): anyone who reads it is a full "
            "member of the deployment; run chmod 600 on it",
            where,
            mode,
        )


def _read(path: Path, flag: str) -> bytes:
    from kvbridge.proto.errors import ConfigError

    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag} {str(path)!r}: {exc.strerror}") from None

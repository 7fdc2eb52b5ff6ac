"""Where a kvbridge server listens and who may call it, checked in one place.

Every port kvbridge serves (the peer control server, the serving node's Inference API,
the offload daemon, ``serve-control``, the metrics endpoint) is described by the same
knobs: a host, a port, and for the gRPC ones an optional shared token and an optional
TLS certificate with its key. :class:`ServerOptions` holds them and checks them in
``__post_init__``; each role's config builds one (``listen``) from its own fields, so a
bad port, token or half a TLS pair is refused with the same message whichever server it
was meant for. :mod:`kvbridge.connector.control.grpc_server` turns the options into a
bound gRPC server. Nothing here imports grpc.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.proto.errors import ConfigError

__all__ = ["ServerOptions", "check_port", "check_tls_pair", "check_token"]


def check_port(port: int, knob: str = "port") -> None:
    """ConfigError naming ``knob`` unless ``port`` is 0 (pick a free one) to 65535."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"{knob} {port} is outside 0..65535 (0 picks a free port)")


def check_token(token: str | None) -> None:
    """ConfigError unless ``token`` is None (no auth) or non-empty printable ASCII."""
    if token is not None and (
        not isinstance(token, str) or not token or not (token.isascii() and token.isprintable())
    ):
        raise ConfigError("token must be non-empty printable ASCII (it travels as metadata)")


def check_tls_pair(
    cert: bytes | None, key: bytes | None, knobs: str = "tls_cert and tls_key"
) -> None:
    """ConfigError naming ``knobs`` unless the certificate and its key come together."""
    if (cert is None) != (key is None):
        raise ConfigError(f"{knobs} go together: give both or neither")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """One listening port: address, optional shared token, optional TLS (built by a config)."""

    host: str = "127.0.0.1"
    port: int = 0
    """0: pick a free port (the server reports the one it got)."""
    token: str | None = None
    """Token every call must carry; a :class:`~kvbridge.connector.control.auth.TokenSet`
    accepts each of its tokens, each a separate peer. None: no auth."""
    tls_cert: bytes | None = None
    """PEM certificate chain: the port speaks TLS only (with ``tls_key``)."""
    tls_key: bytes | None = None
    port_knob: str = "port"
    """The knob that set ``port``, named when it is out of range."""
    tls_knobs: str = "tls_cert and tls_key"
    """The knobs that set the TLS pair, named when only one is given."""

    def __post_init__(self) -> None:
        check_port(self.port, self.port_knob)
        check_token(self.token)
        check_tls_pair(self.tls_cert, self.tls_key, self.tls_knobs)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def bind_address(self) -> str:
        """``host:port`` as gRPC binds it."""
        return f"{self.host}:{self.port}"

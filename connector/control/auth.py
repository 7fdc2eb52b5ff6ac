"""Who may call a kvbridge gRPC server (the shared-token interceptor) and who the caller is.

Every kvbridge port that changes state (peer control, the serving node's
Inference API) installs :class:`TokenInterceptor` when a token is configured:
a call without the token is refused ``UNAUTHENTICATED`` before any handler
runs, so an unauthenticated caller learns nothing. :func:`caller_identity` names
the caller for per-peer bounds (caps on leases and blocks, who may extend a
lease) by what it authenticated with, never by its source address: a token is
named by a hash of it, so every holder of one shared token is one peer. Only a
server without a token falls back to the caller's host, which anyone who can
pick source addresses (127.0.0.2, 127.0.0.3, ... on loopback) can multiply.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import grpc

from kvbridge.connector.control.errors import ERROR_KIND_KEY, TOKEN_KEY, status_for
from kvbridge.proto.errors import AuthError

__all__ = ["TokenInterceptor", "caller_identity", "peer_host", "token_identity"]


def peer_host(peer: str) -> str:
    """The caller's host from gRPC's ``context.peer()`` (``ipv4:1.2.3.4:5678``,
    ``ipv6:[::1]:5678``, ``unix:...``): the one caller identity the server can check."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer


def token_identity(token: str | bytes) -> str:
    """The identity of whoever presents ``token``: ``token:`` + 16 bytes of its SHA-256, so
    the token itself is never kept or logged."""
    raw = token.encode() if isinstance(token, str) else bytes(token)
    return "token:" + hashlib.sha256(b"kvbridge-identity\0" + raw).hexdigest()[:32]


def caller_identity(context: Any, tokens: Sequence[str] = ()) -> str:
    """Who is calling, for per-peer bounds: the one of the server's ``tokens`` the caller
    presented (the :class:`TokenInterceptor` lets only such calls through), else ``addr:``
    + its host (a server without tokens: the address is all there is).

    Only a token the server accepts names a caller: a made-up one next to the real one
    would otherwise make each call a new peer.
    """
    if tokens:
        wanted = [t.encode() for t in tokens]
        for key, value in context.invocation_metadata() or ():
            if key != TOKEN_KEY:
                continue
            got = value.encode() if isinstance(value, str) else bytes(value)
            for token in wanted:
                if hmac.compare_digest(got, token):
                    return token_identity(token)
        raise AuthError("missing or wrong kvbridge token")
    return "addr:" + peer_host(context.peer())


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Rejects every call without the shared token before any handler runs (every
    kvbridge server that changes state installs it: control, Inference)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(requests: object, context: Any) -> None:
            code, kind, message = status_for(AuthError("missing or wrong kvbridge token"))
            context.set_trailing_metadata(((ERROR_KIND_KEY, kind),))
            context.abort(code, message)

        # stream_unary: the answer goes out without waiting for the request body, so a
        # caller that opens calls and never sends one cannot hold the server's threads
        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(got, self._token):
                    return continuation(details)
        return self._deny

"""Who may call a kvbridge gRPC server: the shared-token interceptor and the caller's host.

Every kvbridge port that changes state (peer control, the serving node's
Inference API) installs :class:`TokenInterceptor` when a token is configured:
a call without the token is refused ``UNAUTHENTICATED`` before any handler
runs, so an unauthenticated caller learns nothing. :func:`peer_host` names the
caller for per-peer caps by the one identity the server can check itself.
"""

from __future__ import annotations

import hmac
from typing import Any

import grpc

from kvbridge.connector.control.errors import ERROR_KIND_KEY, TOKEN_KEY, status_for
from kvbridge.proto.errors import AuthError

__all__ = ["TokenInterceptor", "peer_host"]


def peer_host(peer: str) -> str:
    """The caller's host from gRPC's ``context.peer()`` (``ipv4:1.2.3.4:5678``,
    ``ipv6:[::1]:5678``, ``unix:...``): the one caller identity the server can check."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer


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

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

Per-peer bounds need per-peer tokens: a :class:`TokenSet` (read from a token
file, one token a line) makes a server accept each of several tokens, each its
own identity with its own caps. A TokenSet *is* its first token as a string, so
configs and clients that carry one ``token`` string keep working unchanged: a
process that also dials peers sends that first token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from kvbridge.connector.control.errors import ERROR_KIND_KEY, TOKEN_KEY, status_for
from kvbridge.proto.errors import AuthError, ConfigError

__all__ = [
    "TokenInterceptor",
    "TokenSet",
    "accepted_tokens",
    "caller_identity",
    "peer_host",
    "token_identity",
]


class TokenSet(str):
    """Several tokens a server accepts, each a separate identity; as a string, the first.

    The string value is what a process that dials peers sends (one token per
    client); :func:`accepted_tokens` is what its servers accept. Every token must
    travel as metadata: non-empty printable ASCII, else :class:`ConfigError`.
    """

    accepted: tuple[str, ...]

    def __new__(cls, tokens: Iterable[str]) -> TokenSet:
        accepted = tuple(dict.fromkeys(tokens))  # order kept, repeats dropped
        if not accepted:
            raise ConfigError("a token set needs at least one token")
        for token in accepted:
            if not (isinstance(token, str) and token and token.isascii() and token.isprintable()):
                raise ConfigError("every token must be non-empty printable ASCII (metadata)")
        self = super().__new__(cls, accepted[0])
        self.accepted = accepted
        return self

    def __reduce__(self) -> tuple[type[TokenSet], tuple[tuple[str, ...]]]:
        return (TokenSet, (self.accepted,))

    def __repr__(self) -> str:
        return f"TokenSet(<{len(self.accepted)} tokens>)"  # never the secrets themselves


def accepted_tokens(token: str | None) -> tuple[str, ...]:
    """Every token a server configured with ``token`` accepts: none, the one, or each of a
    :class:`TokenSet`'s."""
    if token is None:
        return ()
    if isinstance(token, TokenSet):
        return token.accepted
    return (str(token),)


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
    """Rejects every call without an accepted token before any handler runs (every
    kvbridge server that changes state installs it: control, Inference, offload).
    ``token`` may be a :class:`TokenSet`: each of its tokens is accepted."""

    def __init__(self, token: str) -> None:
        self._tokens = [t.encode() for t in accepted_tokens(token)]

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
                # every token compared: which one matched (or how many were tried) must
                # not show in the time taken
                if sum(hmac.compare_digest(got, t) for t in self._tokens):
                    return continuation(details)
        return self._deny

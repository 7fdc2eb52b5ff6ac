"""The one place where kvbridge errors meet gRPC status codes, both directions.

Server side, :func:`status_for` turns an exception raised by a handler into a
status code, a short error *kind* (sent as trailing metadata, so that the
client can rebuild the precise type) and a message. Unexpected exceptions
become ``INTERNAL`` with a message that reveals nothing; the server logs them.
Client side, :func:`error_from_rpc` turns a failed call back into a typed
kvbridge exception.

======================================  ======================  =======================
server raises                           status                  client raises
======================================  ======================  =======================
``WireError``, ``LayoutError``,         ``INVALID_ARGUMENT``    ``ControlPlaneError``
bytes that do not parse
(:class:`MalformedRequest`)
``VersionMismatchError``                ``FAILED_PRECONDITION`` ``VersionMismatchError``
``IncompatibleLayoutError``             ``FAILED_PRECONDITION`` ``IncompatibleLayoutError``
``LeaseError`` (code ``NOT_FOUND`` or   that code               ``LeaseError``
``FAILED_PRECONDITION``)
``AuthError`` (interceptor)             ``UNAUTHENTICATED``     ``AuthError``
``ControlPlaneError(code=X)``           ``X``                   ``ControlPlaneError``
anything else                           ``INTERNAL``            ``ControlPlaneError``
transport (deadline, unreachable, ...)  as gRPC reports it      ``ControlPlaneError``
======================================  ======================  =======================
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvbridge.proto.errors import (
    AuthError,
    ControlPlaneError,
    IncompatibleLayoutError,
    KVBridgeError,
    LayoutError,
    LeaseError,
    VersionMismatchError,
    WireError,
)

__all__ = [
    "ERROR_KIND_KEY",
    "TOKEN_KEY",
    "status_for",
    "error_from_rpc",
    "lease_not_found",
    "call_handler",
    "MalformedRequest",
    "lenient_deserializer",
]

_log = logging.getLogger(__name__)
Req = TypeVar("Req")
Resp = TypeVar("Resp")

ERROR_KIND_KEY = "kvbridge-error"
"""Trailing-metadata key carrying the error kind."""

TOKEN_KEY = "kvbridge-token"
"""Request-metadata key carrying the shared auth token."""

_INTERNAL_MESSAGE = "internal error in the control server (see its log)"


def lease_not_found(message: str) -> LeaseError:
    """A :class:`LeaseError` that maps to ``NOT_FOUND`` (the lease is unknown or gone)."""
    err = LeaseError(message)
    err.code = "NOT_FOUND"
    return err


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """``(status code, error kind, message)`` for an exception raised by a handler."""
    if isinstance(exc, VersionMismatchError):
        return grpc.StatusCode.FAILED_PRECONDITION, "version_mismatch", str(exc)
    if isinstance(exc, IncompatibleLayoutError):
        return grpc.StatusCode.FAILED_PRECONDITION, "incompatible_layout", str(exc)
    if isinstance(exc, WireError | LayoutError):
        return grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(exc)
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED, "auth", str(exc)
    if isinstance(exc, LeaseError):
        return _code(exc.code, grpc.StatusCode.FAILED_PRECONDITION), "lease", str(exc)
    if isinstance(exc, ControlPlaneError):
        return _code(exc.code, grpc.StatusCode.UNKNOWN), "control", str(exc)
    if isinstance(exc, KVBridgeError):
        return grpc.StatusCode.FAILED_PRECONDITION, "kvbridge", str(exc)
    return grpc.StatusCode.INTERNAL, "internal", _INTERNAL_MESSAGE


def error_from_rpc(method: str, err: grpc.RpcError) -> KVBridgeError:
    """The typed exception for a failed call of ``method``."""
    code: grpc.StatusCode = err.code()
    details = err.details() or code.name
    kind = ""
    trailing = err.trailing_metadata() or ()
    for key, value in trailing:
        if key == ERROR_KIND_KEY:
            kind = value if isinstance(value, str) else value.decode("ascii", "replace")
    message = f"{method}: {details}"
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(message)
    if kind == "version_mismatch":
        return VersionMismatchError(message)
    if kind == "incompatible_layout":
        return IncompatibleLayoutError(details)
    if kind == "lease" or code is grpc.StatusCode.NOT_FOUND:
        lease_err = LeaseError(message)
        lease_err.code = code.name
        return lease_err
    return ControlPlaneError(message, code=code.name)


def _code(name: str, default: grpc.StatusCode) -> grpc.StatusCode:
    code: grpc.StatusCode = getattr(grpc.StatusCode, name, default)
    return code


class MalformedRequest:
    """Stands in for a request whose bytes did not parse (see :func:`lenient_deserializer`)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def lenient_deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, but bytes it rejects become a :class:`MalformedRequest` instead of an
    exception (which gRPC would answer ``INTERNAL``), for :func:`call_handler` to refuse."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:
            return MalformedRequest(f"{type(exc).__name__}: {str(exc)[:200]}")

    return deserialize


def call_handler(handler: Callable[[Req], Resp], request: Req, context: Any) -> Resp:
    """Run a servicer's handler; map what it raises to a status code and an error kind.

    The one place where server-side exceptions become gRPC statuses (every kvbridge
    servicer calls it); unexpected exceptions are logged and answered INTERNAL. A
    request that did not parse (:class:`MalformedRequest`) is answered INVALID_ARGUMENT
    and never reaches the handler.
    """
    try:
        if isinstance(request, MalformedRequest):
            raise WireError(f"malformed request: {request.reason}")
        return handler(request)
    except Exception as exc:
        code, kind, message = status_for(exc)
        name = getattr(handler, "__qualname__", repr(handler))
        if code is grpc.StatusCode.INTERNAL:
            _log.exception("handler %s failed", name)
        else:
            _log.debug("%s rejected (%s): %s", name, code.name, message)
        context.set_trailing_metadata(((ERROR_KIND_KEY, kind),))
        context.abort(code, message)
        raise AssertionError("context.abort returned") from exc

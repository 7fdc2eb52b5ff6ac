"""The offload daemon's gRPC service: ``OffloadStore`` over a NIXL-registered host pool.

Runs in the per-node offload daemon (``kvbridge offload serve``). Laid out
like :mod:`kvbridge.connector.control.server`:
:class:`~kvbridge.worker.offload.handlers.OffloadHandlers` does the work on
protobuf messages and raises typed kvbridge errors; :class:`_Servicer` is a
thin shim that maps them to status codes with
:func:`kvbridge.connector.control.errors.call_handler`; :func:`serve` builds
and starts an :class:`OffloadServer` (a
:class:`~kvbridge.connector.control.grpc_server.ReapingServer`, so the token,
TLS, idle-connection and malformed-request guards are the control server's).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvbridge.connector.control.auth import accepted_tokens, caller_identity
from kvbridge.connector.control.errors import call_handler
from kvbridge.connector.control.grpc_server import ReapingServer, ServedByReaping
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto import offload_pb2_grpc as pb_grpc
from kvbridge.worker.offload.config import OffloadConfig
from kvbridge.worker.offload.handlers import OffloadHandlers

if TYPE_CHECKING:
    from kvbridge.connector.events import BlockEventSink
    from kvbridge.connector.transport.base import Transport

__all__ = ["OffloadConfig", "OffloadHandlers", "OffloadServer", "new_instance", "serve"]

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _Servicer(pb_grpc.OffloadStoreServicer):
    """Thin gRPC shim: call the handler with the caller's authenticated identity (the
    control plane's :func:`~kvbridge.connector.control.auth.caller_identity`), map a raised
    error to a status in one place."""

    def __init__(self, h: OffloadHandlers) -> None:
        self._h = h
        self._tokens = accepted_tokens(h.config.listen.token)

    def _as_caller(self, method: Callable[[Req, str], Resp], request: Req, context: Any) -> Resp:
        def as_caller(r: Req) -> Resp:
            return method(r, caller_identity(context, self._tokens))

        as_caller.__qualname__ = getattr(method, "__qualname__", "handler")  # for the error log
        return call_handler(as_caller, request, context)

    def Handshake(self, request: Any, context: Any) -> pb.OffloadHandshakeResponse:
        return self._as_caller(self._h.handshake, request, context)

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        return call_handler(self._h.lookup, request, context)

    def PrepareStore(self, request: Any, context: Any) -> pb.PrepareStoreResponse:
        return self._as_caller(self._h.prepare_store, request, context)

    def CommitStore(self, request: Any, context: Any) -> pb.CommitStoreResponse:
        return self._as_caller(self._h.commit_store, request, context)

    def AbortStore(self, request: Any, context: Any) -> pb.AbortStoreResponse:
        return self._as_caller(self._h.abort_store, request, context)

    def PrepareLoad(self, request: Any, context: Any) -> pb.PrepareLoadResponse:
        return self._as_caller(self._h.prepare_load, request, context)

    def CompleteLoad(self, request: Any, context: Any) -> pb.CompleteLoadResponse:
        return self._as_caller(self._h.complete_load, request, context)

    def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        return call_handler(self._h.stats, request, context)


class OffloadServer(ServedByReaping):
    """A running ``OffloadStore`` gRPC server plus the reaper that expires dead stores/loads."""

    def __init__(self, handlers: OffloadHandlers) -> None:
        self.handlers = handlers
        config = handlers.config
        self._grpc = ReapingServer.for_config(
            "offload",
            config,
            register=lambda server: pb_grpc.add_OffloadStoreServicer_to_server(
                _Servicer(handlers), server
            ),
            reap=handlers.expire,
            idle_timeout_s=config.idle_timeout_s,
        )

    def start(self) -> OffloadServer:
        self._grpc.start()
        log.info("offload daemon %s listening on %s", self.handlers.instance, self.address)
        return self

    def close(self, grace_s: float = 1.0) -> None:
        """Stop serving, stop the reaper, drop pending work and unregister the pool."""
        if self._grpc.close(grace_s):
            self.handlers.close()


def new_instance() -> str:
    """A daemon instance id: 32 random lowercase hex digits, new on every start."""
    return secrets.token_hex(16)


def serve(
    transport: Transport,
    config: OffloadConfig | None = None,
    *,
    instance: str | None = None,
    events: Callable[[int], BlockEventSink] | None = None,
    disk_events: Callable[[int], BlockEventSink] | None = None,
) -> OffloadServer:
    """Start an offload daemon's service on ``transport`` (which the caller closes after);
    ``events(block_size)`` makes the pool's KV event sink (see ``OffloadHandlers``)."""
    handlers = OffloadHandlers(
        transport,
        config or OffloadConfig(),
        instance=instance or new_instance(),
        events=events,
        disk_events=disk_events,
    )
    return OffloadServer(handlers).start()

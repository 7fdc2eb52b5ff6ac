"""Hand-written gRPC fakes on loopback: a server that records who called it, and a proxy.

Both take any method on raw bytes (a generic handler), so they stand in for a
peer's control server without knowing its protocol.
"""

from __future__ import annotations

import threading
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc


class _Generic(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def service(self, details: Any) -> Any:
        method = details.method
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: self._handle(method, request, context)
        )


class _Server:
    def __init__(self, host: str) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(8))
        self._server.add_generic_rpc_handlers([_Generic(self._handle)])
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{self.port}"
        self._server.start()

    def _handle(self, method: str, request: bytes, context: Any) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        self._server.stop(0).wait()

    def __enter__(self) -> _Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RecordingServer(_Server):
    """Answers every call UNIMPLEMENTED and remembers ``(method, metadata)`` of each."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        super().__init__(host)

    def _handle(self, method: str, request: bytes, context: Any) -> bytes:
        self.calls.append((method, {k: str(v) for k, v in context.invocation_metadata()}))
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "recorded")
        raise AssertionError("abort returned")


class HoldingProxy(_Server):
    """Forwards every call to ``target`` (kvbridge metadata included); while
    ``hold_releases`` is set, ``Release`` calls are held until their deadline
    instead: a peer that is unreachable for releases only."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.target = ""
        self.hold_releases = threading.Event()
        self.held = 0
        self._closing = threading.Event()
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        super().__init__(host)

    def _handle(self, method: str, request: bytes, context: Any) -> bytes:
        if method.endswith("/Release") and self.hold_releases.is_set():
            with self._lock:
                self.held += 1
            self._closing.wait(context.time_remaining())
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "held by the proxy")
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(self.target)
            channel = self._channel
        metadata = [(k, v) for k, v in context.invocation_metadata() if k.startswith("kvbridge")]
        try:
            answer: bytes = channel.unary_unary(method)(
                request, metadata=metadata, timeout=max(context.time_remaining(), 0.01)
            )
        except grpc.RpcError as err:
            context.set_trailing_metadata(err.trailing_metadata() or ())
            context.abort(err.code(), err.details())
        return answer

    def close(self) -> None:
        self._closing.set()
        super().close()
        if self._channel is not None:
            self._channel.close()

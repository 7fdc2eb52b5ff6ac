"""A gRPC server with a reaper thread: the lifecycle both kvbridge servers share.

The peer control server expires leases and the offload daemon expires dead
stores and loads the same way: a daemon thread calls ``reap`` every
``reap_interval_s`` while the server runs. :class:`ReapingServer` owns both
and stops both in ``close()``; the owner then does its own cleanup.

It is also the one place where both servers get the same guards:

- ``token``: :class:`~kvbridge.connector.control.auth.TokenInterceptor` rejects
  every call without the shared token (metadata
  :data:`~kvbridge.connector.control.errors.TOKEN_KEY`) before any handler runs;
  ``credentials`` (:func:`tls_credentials`) serve TLS;
- malformed request bytes reach the handler as a
  :class:`~kvbridge.connector.control.errors.MalformedRequest`, which
  :func:`~kvbridge.connector.control.errors.call_handler` answers
  ``INVALID_ARGUMENT`` (gRPC itself would answer ``INTERNAL``);
- idle connections are closed after ``idle_timeout_s``, dead peers are found
  by keepalive pings, and at most ``max_concurrent_rpcs`` calls run or wait
  (the rest are refused ``RESOURCE_EXHAUSTED``) on ``max_workers`` threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from kvbridge.connector.control.auth import TokenInterceptor
from kvbridge.connector.control.errors import (
    lenient_deserializer,
)
from kvbridge.proto.errors import ConfigError

__all__ = ["LenientRequests", "ReapingServer", "tls_credentials"]

log = logging.getLogger(__name__)


class LenientRequests(grpc.ServerInterceptor):  # type: ignore[misc]
    """Wraps each unary-unary handler's deserializer with :func:`lenient_deserializer`."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            handler.unary_unary,
            request_deserializer=lenient_deserializer(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def tls_credentials(cert: bytes | None, key: bytes | None) -> grpc.ServerCredentials | None:
    """Server TLS credentials from a PEM certificate chain and key; None (plaintext) without."""
    if (cert is None) != (key is None):
        raise ConfigError("tls_cert and tls_key go together: give both or neither")
    if cert is None or key is None:
        return None
    return grpc.ssl_server_credentials([(key, cert)])


class ReapingServer:
    """A bound (not yet started) gRPC server plus its reaper; ``start``, then ``close``."""

    def __init__(
        self,
        *,
        name: str,
        host: str,
        port: int,
        max_workers: int,
        max_message_bytes: int,
        register: Callable[[grpc.Server], None],
        reap: Callable[[], object],
        reap_interval_s: float,
        interceptors: Sequence[Any] = (),
        max_concurrent_rpcs: int | None = None,
        credentials: grpc.ServerCredentials | None = None,
        token: str | None = None,
        idle_timeout_s: float = 300.0,
        keepalive_s: float = 60.0,
    ) -> None:
        if idle_timeout_s <= 0 or keepalive_s <= 0:
            raise ConfigError(
                f"idle_timeout_s ({idle_timeout_s}) and keepalive_s ({keepalive_s}) must be > 0"
            )
        self.host = host
        self._reap_fn = reap
        self._interval = reap_interval_s
        self._name = name
        guards = [] if token is None else [TokenInterceptor(token)]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"kvbridge-{name}"),
            interceptors=[*guards, *interceptors, LenientRequests()],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.max_connection_idle_ms", round(idle_timeout_s * 1000)),
                ("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", round(min(keepalive_s, 20.0) * 1000)),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.max_concurrent_streams", 2 * max_workers),
            ],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        register(self._server)
        bind = f"{host}:{port}"
        if credentials is not None:
            self.port = self._server.add_secure_port(bind, credentials)
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise ConfigError(f"cannot listen on {bind}: address in use or not local")
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap, name=f"kvbridge-{name}-reaper", daemon=True
        )
        self._closed = False

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> None:
        self._server.start()
        self._reaper.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops (or ``timeout_s`` passes); True if it stopped."""
        timed_out: bool = self._server.wait_for_termination(timeout_s)
        return not timed_out

    def close(self, grace_s: float = 1.0) -> bool:
        """Stop serving and stop the reaper; False if it was already closed."""
        if self._closed:
            return False
        self._closed = True
        self._server.stop(grace_s).wait()
        self._stop.set()
        if self._reaper.is_alive():
            self._reaper.join()
        return True

    def _reap(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._reap_fn()
            except Exception:
                log.exception("%s reaper failed", self._name)

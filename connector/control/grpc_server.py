"""How every kvbridge gRPC server is built, bound and guarded; the reaping lifecycle.

:func:`new_server` and :func:`bind` are the one place every kvbridge gRPC port (peer
control, the offload daemon, the serving node's Inference API) gets its guards from
its :class:`~kvbridge.connector.server_options.ServerOptions`:

- a token: :class:`~kvbridge.connector.control.auth.TokenInterceptor` rejects
  every call without it (metadata :data:`~kvbridge.connector.control.errors.TOKEN_KEY`)
  before any handler runs; a certificate: the port speaks TLS only;
- malformed request bytes reach the handler as a
  :class:`~kvbridge.connector.control.errors.MalformedRequest`, which
  :func:`~kvbridge.connector.control.errors.call_handler` answers
  ``INVALID_ARGUMENT`` (gRPC itself would answer ``INTERNAL``);
- a taken port is a :class:`ConfigError`, never a port shared with another process.

The peer control server expires leases and the offload daemon expires dead stores and
loads the same way: :class:`ReapingServer` adds a daemon thread that calls ``reap``
every ``reap_interval_s`` while the server runs, closes idle connections after
``idle_timeout_s``, finds dead peers by keepalive pings, and lets at most
``max_concurrent_rpcs`` calls run or wait (the rest are refused ``RESOURCE_EXHAUSTED``)
on ``max_workers`` threads; ``close()`` stops both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from kvbridge.connector.control.auth import TokenInterceptor
from kvbridge.connector.control.errors import lenient_deserializer
from kvbridge.connector.server_options import ServerOptions
from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import ConfigError

if TYPE_CHECKING:
    from kvbridge.connector.control.types import ControlLimits

__all__ = ["LenientRequests", "ReapingServer", "ServedByReaping", "bind", "new_server"]

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


def new_server(
    name: str,
    options: ServerOptions,
    *,
    max_workers: int,
    max_concurrent_rpcs: int | None,
    grpc_options: Sequence[tuple[str, Any]] = (),
) -> grpc.Server:
    """A gRPC server (not yet bound) with the guards every kvbridge port has: the token
    interceptor when ``options`` has a token, malformed requests answered
    ``INVALID_ARGUMENT``, and a taken port an error instead of a shared one."""
    guards = [] if options.token is None else [TokenInterceptor(options.token)]
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"kvbridge-{name}"),
        interceptors=[*guards, LenientRequests()],
        options=[("grpc.so_reuseport", 0), *grpc_options],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )


def bind(server: grpc.Server, options: ServerOptions, hint: str = "") -> int:
    """Bind ``server`` to ``options``' address (TLS only when it has a certificate); the
    port it got. ConfigError (``hint`` appended) if the address is taken or not local."""
    bound: int
    try:
        if options.tls_cert is not None and options.tls_key is not None:
            creds = grpc.ssl_server_credentials([(options.tls_key, options.tls_cert)])
            bound = server.add_secure_port(options.bind_address, creds)
        else:
            bound = server.add_insecure_port(options.bind_address)
    except RuntimeError:  # newer gRPC raises where older returned 0
        bound = 0
    if bound == 0:
        raise ConfigError(
            f"cannot listen on {options.bind_address}: address in use or not local{hint}"
        )
    return bound


class ServerConfig(Protocol):
    """What a reaping server reads from its role's config (``ControlServerConfig``,
    ``OffloadConfig``)."""

    @property
    def listen(self) -> ServerOptions: ...
    @property
    def max_workers(self) -> int: ...
    @property
    def max_concurrent_rpcs(self) -> int: ...
    @property
    def reap_interval_s(self) -> float: ...
    @property
    def limits(self) -> ControlLimits: ...


class ReapingServer:
    """A bound (not yet started) gRPC server plus its reaper; ``start``, then ``close``."""

    @classmethod
    def for_config(
        cls,
        name: str,
        config: ServerConfig,
        *,
        register: Callable[[grpc.Server], None],
        reap: Callable[[], object],
        idle_timeout_s: float = 300.0,
    ) -> ReapingServer:
        """The server a role's config describes, serving what ``register`` adds."""
        return cls(
            name=name,
            options=config.listen,
            max_workers=config.max_workers,
            max_message_bytes=config.limits.max_message_bytes,
            register=register,
            reap=reap,
            reap_interval_s=config.reap_interval_s,
            max_concurrent_rpcs=config.max_concurrent_rpcs,
            idle_timeout_s=idle_timeout_s,
        )

    def __init__(
        self,
        *,
        name: str,
        options: ServerOptions,
        max_workers: int,
        max_message_bytes: int,
        register: Callable[[grpc.Server], None],
        reap: Callable[[], object],
        reap_interval_s: float,
        max_concurrent_rpcs: int | None = None,
        idle_timeout_s: float = 300.0,
        keepalive_s: float = 60.0,
    ) -> None:
        if idle_timeout_s <= 0 or keepalive_s <= 0:
            raise ConfigError(
                f"idle_timeout_s ({idle_timeout_s}) and keepalive_s ({keepalive_s}) must be > 0"
            )
        self.host = options.host
        self._register = register
        self._reap_fn = reap
        self._interval = reap_interval_s
        self._name = name
        self._server = new_server(
            name,
            options,
            max_workers=max_workers,
            max_concurrent_rpcs=max_concurrent_rpcs,
            grpc_options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_connection_idle_ms", round(idle_timeout_s * 1000)),
                ("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", round(min(keepalive_s, 20.0) * 1000)),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.max_concurrent_streams", 2 * max_workers),
            ],
        )
        self.port = bind(self._server, options)
        self._stop = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap, name=f"kvbridge-{name}-reaper", daemon=True
        )
        self._closed = False

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def start(self) -> None:
        """Add the service (``register``) and start serving and reaping. The port is bound
        from construction on, so its address can be handed out before the service exists."""
        self._register(self._server)
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


class ServedByReaping(Closing):
    """A kvbridge service on a :class:`ReapingServer` (``_grpc``): its port, address and
    ``wait``; the service says how it starts and what closing it also releases."""

    _grpc: ReapingServer

    @property
    def port(self) -> int:
        return self._grpc.port

    @property
    def address(self) -> str:
        return self._grpc.address

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops (or ``timeout_s`` passes); True if it stopped."""
        return self._grpc.wait(timeout_s)

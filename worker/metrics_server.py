"""``GET /metrics`` for one prometheus_client registry (offload daemon, serving node).

prometheus_client's WSGI app renders the registry; wsgiref's threading server
(the one behind ``prometheus_client.start_http_server``) serves it, with two
additions that function lacks: every connection gets a socket timeout, so an
idle or slow client frees its thread after ``idle_timeout_s`` instead of
pinning it until the process exits, and at most ``max_connections`` are open
at once: a new connection past that closes the *oldest* open one, so a scrape
always gets through however many idle connections others hold (they are the
oldest; a scrape is served in milliseconds). The registry is the caller's:
nothing here touches prometheus_client's global default registry.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvbridge.connector.server_options import check_port
from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["MetricsServerConfig", "MetricsServer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MetricsServerConfig:
    """Where to listen and how long a quiet client may hold a connection."""

    host: str = "127.0.0.1"
    port: int = 0
    """0: pick a free port (read it back from :attr:`MetricsServer.port`)."""
    idle_timeout_s: float = 10.0
    max_connections: int = 16

    def __post_init__(self) -> None:
        check_port(self.port, "metrics port")
        if not self.idle_timeout_s > 0:
            raise ConfigError(f"metrics idle_timeout_s must be > 0 s, got {self.idle_timeout_s}")
        if self.max_connections < 1:
            raise ConfigError(f"metrics max_connections must be >= 1, got {self.max_connections}")


class _Handler(WSGIRequestHandler):
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.config.idle_timeout_s)

    def handle(self) -> None:
        try:
            super().handle()
        except TimeoutError:
            idle = self.server.config.idle_timeout_s
            log.debug("metrics: closed a connection idle for %ss", idle)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics: " + format, *args)


class _Server(ThreadingWSGIServer):
    request_queue_size = 128  # the listen backlog: a burst of connects waits, not fails

    def __init__(self, config: MetricsServerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._open: OrderedDict[int, socket.socket] = OrderedDict()  # oldest first
        if ":" in config.host:
            self.address_family = socket.AF_INET6
        WSGIServer.__init__(self, (config.host, config.port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            oldest = []
            while len(self._open) >= self.config.max_connections:
                oldest.append(self._open.popitem(last=False)[1])
            self._open[id(request)] = request
        for sock in oldest:
            log.debug("metrics: %d connections open; closing the oldest", len(self._open))
            with contextlib.suppress(OSError):  # its handler thread then ends
                sock.shutdown(socket.SHUT_RDWR)
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                if self._open.get(id(request)) is request:
                    del self._open[id(request)]


class MetricsServer(Closing):
    """Serves ``registry`` from a daemon thread until :meth:`close`."""

    def __init__(self, registry: CollectorRegistry, config: MetricsServerConfig) -> None:
        try:
            self._httpd = _Server(config)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {config.host}:{config.port} ({exc}); pick another port"
            ) from exc
        self._httpd.set_app(make_wsgi_app(registry))
        self.host = config.host
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvbridge-metrics", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

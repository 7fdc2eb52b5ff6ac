"""A gRPC server with a reaper thread: the lifecycle both kvbridge servers share.

The peer control server expires leases and the offload daemon expires dead
stores and loads the same way: a daemon thread calls ``reap`` every
``reap_interval_s`` while the server runs. :class:`ReapingServer` owns both
and stops both in ``close()``; the owner then does its own cleanup.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from kvbridge.proto.errors import ConfigError

__all__ = ["ReapingServer"]

log = logging.getLogger(__name__)


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
    ) -> None:
        self.host = host
        self._reap_fn = reap
        self._interval = reap_interval_s
        self._name = name
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"kvbridge-{name}"),
            interceptors=list(interceptors),
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
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

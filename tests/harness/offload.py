"""The offload daemon and ``offload_worker`` helpers as processes, driven by a test."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbridge.connector.transport import LocalMemory
from kvbridge.proto import KVLayout
from kvbridge.worker import ChildProcess, listening_on
from tests.harness.peer import PeerProc, start_peers

if TYPE_CHECKING:
    import torch

WORKER_MODULE = "tests.harness.offload_worker"


class FakeTransport:
    """An offload daemon's transport that registers nothing real (the handlers never move
    data) and delivers the notifications a test puts in ``notifications`` or :meth:`notify`."""

    name = "fake-offload-agent"

    def __init__(self) -> None:
        self.notifications: dict[str, list[bytes]] = {}
        self.lock = threading.Lock()

    def register(self, layout: KVLayout, kv: Mapping[str, torch.Tensor]) -> LocalMemory:
        return LocalMemory(1, layout.bind(kv), "cpu")

    def unregister(self, memory: LocalMemory) -> None:
        pass

    def metadata(self) -> bytes:
        return b"fake-metadata"

    def poll_notifications(self) -> dict[str, list[bytes]]:
        with self.lock:
            out, self.notifications = self.notifications, {}
        return out

    def notify(self, agent: str, message: bytes) -> None:
        with self.lock:
            self.notifications.setdefault(agent, []).append(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DaemonProc:
    """``python -m kvbridge.worker.offload.cmd`` (``kvbridge offload serve``), ready once it
    prints its ``listening on`` banner; :meth:`stop` ends it."""

    def __init__(self, *args: str, port: int | None = None, timeout_s: float = 60.0) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.child = ChildProcess(
            [sys.executable, "-m", "kvbridge.worker.offload.cmd", "--port", str(self.port), *args],
            name="offload daemon",
            ready=listening_on,
            ready_timeout_s=timeout_s,
        )
        self.banner: str = self.child.wait_ready()["banner"]

    def log(self) -> str:
        return self.child.log()

    def kill(self) -> None:
        self.child.kill()

    def stop(self) -> None:
        self.child.close(grace_s=20)


class WorkerProc(PeerProc):
    """An ``offload_worker`` process (same framed protocol as the transport peers)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, module=WORKER_MODULE)


def start_workers(*names: str) -> list[PeerProc]:
    return start_peers(*names, module=WORKER_MODULE)

"""Test-side drivers of an offload daemon process and ``offload_worker.py`` processes."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from transport_harness import PeerProc

WORKER_SCRIPT = Path(__file__).with_name("offload_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DaemonProc:
    """``python -m kvbridge.worker.offload.cmd`` (``kvbridge offload serve``); stop() ends it."""

    def __init__(self, *args: str, port: int | None = None, timeout_s: float = 60.0) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        env = {**os.environ, "UCX_MODULES": "^ib"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.worker.offload.cmd", "--port", str(self.port), *args],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if "listening on" in line:
                self.banner = line
                break
            if not line:
                log = self.log()  # before stop() closes it
                self.stop()
                raise AssertionError(f"offload daemon did not start: {log}")

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if not self.stderr.closed:
            self.stderr.close()


class WorkerProc(PeerProc):
    """An ``offload_worker.py`` process (same framed protocol as the transport peers)."""

    def __init__(self, name: str) -> None:
        import transport_harness

        original = transport_harness.PEER_SCRIPT
        transport_harness.PEER_SCRIPT = WORKER_SCRIPT
        try:
            super().__init__(name)
        finally:
            transport_harness.PEER_SCRIPT = original


def start_workers(*names: str) -> list[WorkerProc]:
    workers = [WorkerProc(n) for n in names]
    try:
        for w in workers:
            w.wait_ready()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers

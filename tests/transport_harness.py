"""Test-side driver of ``tests/transport_peer.py`` processes (no NIXL/UCXX in the test process)."""

from __future__ import annotations

import os
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack

PEER_SCRIPT = Path(__file__).with_name("transport_peer.py")


class PeerError(AssertionError):
    """The peer answered a request with an error."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error
        self.message = message


class PeerProc:
    """One ``transport_peer.py`` process; :meth:`stop` always ends it."""

    def __init__(self, name: str, env: dict[str, str] | None = None, backend: str = "nixl") -> None:
        self.name = name
        self.backend = backend
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        full_env = {**os.environ, "UCX_MODULES": "^ib", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), name, backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=full_env,
        )
        self._replies: queue.Queue[Any] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            while len(head := out.read(4)) == 4:
                (n,) = struct.unpack(">I", head)
                self._replies.put(msgpack.unpackb(out.read(n), raw=False))
        except (ValueError, OSError, msgpack.UnpackException):
            pass
        self._replies.put(None)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        reply = self._replies.get(timeout=timeout_s)
        assert reply and reply.get("ok"), f"peer {self.name} did not start: {self.log()}"

    def send(self, op: str, **kwargs: Any) -> None:
        body = msgpack.packb({"op": op, **kwargs}, use_bin_type=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = 30.0) -> dict[str, Any]:
        reply = self._replies.get(timeout=timeout_s)
        if reply is None:
            raise AssertionError(f"peer {self.name} exited: {self.log()}")
        if not reply["ok"]:
            raise PeerError(reply["error"], reply["message"])
        result: dict[str, Any] = reply
        return result

    def call(self, op: str, rpc_timeout: float = 30.0, **kwargs: Any) -> dict[str, Any]:
        self.send(op, **kwargs)
        return self.reply(rpc_timeout)

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP, return only once every thread has stopped (kill() is
        asynchronous: a request sent right after it could still be served)."""
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            stat = Path(f"/proc/{self.proc.pid}/stat")
            deadline = time.monotonic() + 10
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline, f"peer {self.name} did not stop"
                time.sleep(0.005)

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def close(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """Close the transport cleanly and wait for exit; returns the peer's last state."""
        state = self.call("close", rpc_timeout=timeout_s)
        self.proc.wait(timeout=timeout_s)
        return state

    def stop(self) -> None:
        """End the process whatever state it is in (idempotent)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=20)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.stderr.close()


def start_peers(
    *names: str, env: dict[str, str] | None = None, backend: str = "nixl"
) -> list[PeerProc]:
    """Start peers concurrently (each takes seconds to import torch and its transport)."""
    peers = [PeerProc(n, env, backend) for n in names]
    try:
        for p in peers:
            p.wait_ready()
    except BaseException:
        for p in peers:
            p.stop()
        raise
    return peers

"""The test side of a helper process (``transport_peer``, ``offload_worker``).

The test process loads no NIXL: each transport lives in its own
:class:`~kvbridge.worker.ChildProcess`, spoken to in ``frames``.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack

from kvbridge.worker import ChildProcess
from tests.harness.frames import read_frame, write_frame

ROOT = Path(__file__).resolve().parents[2]


class PeerError(AssertionError):
    """The peer answered a request with an error."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error
        self.message = message


class PeerProc:
    """One helper process (``python -m tests.harness.MODULE NAME [ARGS]``); :meth:`stop`
    always ends it. Starts at once; :meth:`wait_ready` waits for its ``READY`` line."""

    def __init__(
        self,
        name: str,
        env: dict[str, str] | None = None,
        backend: str = "nixl",
        module: str = "tests.harness.transport_peer",
    ) -> None:
        self.name = name
        self.backend = backend
        self.child = ChildProcess(
            [sys.executable, "-m", module, name, backend],
            name=f"peer {name}",
            env=env,
            cwd=ROOT,
            stdin=True,
            keep_stdout=True,
        )
        self._replies: queue.Queue[Any] = queue.Queue()
        self._reader: threading.Thread | None = None

    def _read(self) -> None:
        try:
            while (reply := read_frame(self.child.stdout)) is not None:
                self._replies.put(reply)
        except (ValueError, OSError, msgpack.UnpackException):
            pass
        self._replies.put(None)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self.child.wait_ready(timeout_s)
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def send(self, op: str, **kwargs: Any) -> None:
        write_frame(self.child.stdin, {"op": op, **kwargs})

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
        """Send ``sig``; SIGSTOP returns once every thread has stopped."""
        self.child.send_signal(sig)

    def log(self) -> str:
        return self.child.log()

    def close(self, timeout_s: float = 20.0) -> dict[str, Any]:
        """Close the transport cleanly and wait for exit; returns the peer's last state."""
        state = self.call("close", rpc_timeout=timeout_s)
        self.child.wait(timeout=timeout_s)
        return state

    def stop(self) -> None:
        """End the process whatever state it is in (idempotent)."""
        self.child.kill()
        if self._reader is not None:
            self._reader.join(timeout=10)
        self.child.close(grace_s=0)


def start_peers(
    *names: str,
    env: dict[str, str] | None = None,
    backend: str = "nixl",
    module: str = "tests.harness.transport_peer",
) -> list[PeerProc]:
    """Start peers concurrently (each takes seconds to import torch and its transport)."""
    peers: list[PeerProc] = []
    try:
        for n in names:
            peers.append(PeerProc(n, env, backend, module))
        for p in peers:
            p.wait_ready()
    except BaseException:
        for p in peers:
            p.stop()
        raise
    return peers


@contextmanager
def attacker_peer(name: str = "mallory") -> Iterator[PeerProc]:
    """A token holder's own NIXL agent (a ``transport_peer`` process) for the attack tests:
    its ``forge`` op WRITEs junk into a remote memory a handshake described. Each ``forge``
    unregisters what it registered, so one process serves any number of tests; the caller
    checks :func:`attacker_idle` after each."""
    env = {**os.environ, "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")}
    (peer,) = start_peers(name, env=env)
    try:
        yield peer
    finally:
        peer.stop()


def attacker_idle(peer: PeerProc) -> dict[str, Any]:
    """The attacker's transport state once a test is done: no transfer pending or leaked,
    no link or memory left over (``forge`` cleans up after itself)."""
    state = peer.call("state")
    assert state["pending"] == 0 and state["leaked"] == 0, state
    assert state["links"] == 0 and state["memories"] == 0, state
    return state

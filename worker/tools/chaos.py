"""A deployment of real processes that a soak run kills, stops and restarts.

:class:`Deployment` owns the ``kvbridge serve`` nodes and the offload daemon
of ``kvbridge soak``: each runs on ports fixed at first start, so a restarted
process comes back at the same addresses under the same engine id (the way a
supervisor restarts a pod behind a stable address). :func:`chaos_schedule`
draws what happens to them from a seed; :meth:`Deployment.run_chaos` plays it,
one process at a time.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.proto.errors import KVBridgeError
from kvbridge.worker.tools.soak_config import SoakConfig

if TYPE_CHECKING:
    from kvbridge.worker.child import ChildProcess
    from kvbridge.worker.serving.router import EngineClient

__all__ = ["ChaosEvent", "chaos_schedule", "Deployment"]

OFFLOAD = "offload"
KILL_ESTIMATE_S = 8.0
"""What a kill and restart is assumed to take when the schedule is drawn."""


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    """Wait ``gap_s`` after the previous event, then ``action`` (kill or stop) ``target``."""

    gap_s: float
    action: str
    target: str
    stop_s: float = 0.0
    """How long a stopped process stays stopped."""


def chaos_schedule(seed: int, targets: list[str], config: SoakConfig) -> list[ChaosEvent]:
    """Enough events to fill ``config.duration_s``, the same for the same seed; the first
    two are one kill and one stop, so even a short run has both."""
    rng = random.Random(f"chaos-{seed}")
    first = ["kill", "stop"]
    rng.shuffle(first)
    events: list[ChaosEvent] = []
    planned = 0.0
    while planned < config.duration_s:
        action = first.pop(0) if first else rng.choice(["kill", "stop"])
        stop_s = round(rng.uniform(0.5, 2.5) * config.lease_ttl_s, 2) if action == "stop" else 0
        gap = round(rng.uniform(0.5, 2.5), 2)
        events.append(ChaosEvent(gap, action, rng.choice(targets), stop_s))
        planned += gap + (stop_s or KILL_ESTIMATE_S)
    return events


@dataclass(slots=True)
class _Slot:
    name: str
    role: str
    ports: tuple[int, int]
    stack: ExitStack
    proc: ChildProcess | None = None


class Deployment:
    """Prefill and decode nodes and an offload daemon as processes; ``close()`` ends them."""

    def __init__(
        self,
        config: SoakConfig,
        engine_args: argparse.Namespace,
        workdir: Path,
        progress: Callable[[str], None],
    ) -> None:
        self.config = config
        self.args = engine_args
        self.workdir = workdir
        self.progress = progress
        self.kills = 0
        self.stops = 0
        self.log: list[str] = []
        """One line per chaos event, stamped with :meth:`elapsed`."""
        self._slots: dict[str, _Slot] = {}
        self._clients: dict[str, EngineClient] = {}
        self._offload_address = ""
        self._t0 = time.monotonic()

    def start_clock(self) -> None:
        """Zero :meth:`elapsed`: the soak calls it as its load phase starts."""
        self._t0 = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since :meth:`start_clock` (or since the deployment was made): the one
        clock of the soak's progress lines, chaos log and wrong-answer records."""
        return time.monotonic() - self._t0

    # ----- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start every process (nodes in parallel) and wait until each serves."""
        from kvbridge.worker.serving.router import EngineClient

        if self.config.offload:
            self._slots[OFFLOAD] = _Slot(OFFLOAD, OFFLOAD, (_free_port(), 0), ExitStack())
            self._start(OFFLOAD)
        roles = [("prefill", self.config.prefill_nodes), ("decode", self.config.decode_nodes)]
        for role, n in roles:
            for i in range(n):
                name = f"{role}{i}"
                self._slots[name] = _Slot(name, role, (_free_port(), _free_port()), ExitStack())
        nodes = [s.name for s in self._slots.values() if s.role != OFFLOAD]
        errors: list[BaseException] = []

        def start_one(name: str) -> None:
            try:
                self._start(name)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start_one, args=(n,)) for n in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for name in nodes:
            self._clients[name] = EngineClient(
                f"127.0.0.1:{self._slots[name].ports[0]}", timeout_s=self.config.attempt_timeout_s
            )

    def targets(self) -> list[str]:
        return sorted(self._slots)

    def clients(self, role: str) -> list[EngineClient]:
        """Inference clients of ``role``'s nodes; their addresses survive restarts."""
        return [c for name, c in sorted(self._clients.items()) if self._slots[name].role == role]

    def heal(self) -> None:
        """Continue every stopped process and restart every dead one."""
        for slot in self._slots.values():
            if slot.proc is not None and slot.proc.poll() is None:
                os.kill(slot.proc.pid, signal.SIGCONT)
            elif slot.proc is not None:
                self._note(f"{slot.name} was down at the end; restarting")
                slot.stack.close()
                self._start(slot.name)

    def close(self) -> None:
        for slot in self._slots.values():
            if slot.proc is not None and slot.proc.poll() is None:
                os.kill(slot.proc.pid, signal.SIGCONT)  # a stopped process cannot terminate
            slot.stack.close()
        for client in self._clients.values():
            client.close()

    # ----- chaos ---------------------------------------------------------------------------
    def run_chaos(self, events: list[ChaosEvent], stop: threading.Event) -> None:
        """Play ``events`` until they run out or ``stop`` is set (a stopped process is
        always continued, a killed one always restarted, before the next event)."""
        for event in events:
            if stop.wait(event.gap_s):
                return
            slot = self._slots[event.target]
            assert slot.proc is not None
            if event.action == "kill":
                self._note(f"SIGKILL {slot.name} (pid {slot.proc.pid}), restart")
                slot.proc.kill()
                slot.proc.wait()
                self.kills += 1
                slot.stack.close()
                try:
                    self._start(slot.name)
                except Exception as exc:  # heal() tries again; the leak check reports it
                    self._note(f"restart of {slot.name} failed: {exc}")
                    return
                self._note(f"{slot.name} is back (pid {slot.proc.pid})")
            else:
                self._note(f"SIGSTOP {slot.name} (pid {slot.proc.pid}) for {event.stop_s}s")
                os.kill(slot.proc.pid, signal.SIGSTOP)
                self.stops += 1
                try:
                    time.sleep(event.stop_s)
                finally:
                    os.kill(slot.proc.pid, signal.SIGCONT)
                self._note(f"SIGCONT {slot.name}")

    # ----- checks --------------------------------------------------------------------------
    def check_no_leaks(self, timeout_s: float) -> list[str]:
        """Every node's pools full and leases gone, and no offload pin or open store, within
        ``timeout_s`` (abandoned leases expire on their own)."""
        from kvbridge.worker.tools.demo import check_no_leaks

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                problems = check_no_leaks(dict(self._clients), timeout_s=0)
            except KVBridgeError as exc:
                problems = [str(exc)]
            problems += self._offload_problems()
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.5)

    def _offload_problems(self) -> list[str]:
        if not self._offload_address:
            return []
        import grpc

        from kvbridge.proto import offload_pb2 as opb
        from kvbridge.proto import offload_pb2_grpc as opb_grpc

        with grpc.insecure_channel(self._offload_address) as channel:
            try:
                stats = opb_grpc.OffloadStoreStub(channel).Stats(opb.StatsRequest(), timeout=5)
            except grpc.RpcError as exc:
                return [f"offload daemon: Stats failed: {exc.code().name}"]
        return [
            f"offload daemon: {n} blocks {what}"
            for n, what in ((stats.pinned_blocks, "pinned"), (stats.writing_blocks, "in stores"))
            if n
        ]

    # ----- helpers -------------------------------------------------------------------------
    def _start(self, name: str) -> None:
        from kvbridge.worker.tools.demo import start_node, start_offload_daemon

        slot = self._slots[name]
        slot.stack = ExitStack()
        timeout = getattr(self.args, "startup_timeout", 120.0)
        if slot.role == OFFLOAD:
            daemon = slot.stack.enter_context(
                start_offload_daemon(self.workdir, timeout, port=slot.ports[0])
            )
            slot.proc, self._offload_address = daemon.proc, daemon.address
            return
        c = self.config
        extra = [
            *("--port", str(slot.ports[0]), "--control-port", str(slot.ports[1])),
            *("--lease-ttl", str(c.lease_ttl_s), "--load-timeout", str(c.load_timeout_s)),
            *(("--offload", self._offload_address) if self._offload_address else ()),
        ]
        args: Any = self.args
        slot.proc, _ = slot.stack.enter_context(
            start_node(name, args, args.order, self.workdir, None, extra, role=slot.role)
        )

    def _note(self, line: str) -> None:
        line = f"{self.elapsed():7.1f}s {line}"
        self.log.append(line)
        self.progress(f"chaos: {line}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port

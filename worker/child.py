"""One way to start a child process and know it is ready: a line on its stdout.

:class:`ChildProcess` starts a command (``python -m ...``), reads its stdout
line by line until a *readiness test* accepts one, and from then on either
hands stdout to its owner (``keep_stdout=True``: a framed or line protocol
follows) or drains it in the background so the child never blocks on a full
pipe. stderr goes to a log file (a temporary one unless ``log`` is given),
which :meth:`ChildProcess.log` returns for error messages.

Readiness tests map one line to the child's ready info, or ``None`` to keep
reading: :func:`ready_prefix` (the ``READY {json}`` line of kvbridge's own
helper processes), :func:`json_object` (``kvbridge serve`` prints its addresses
as one JSON object) and :func:`listening_on` (the daemons' ``... listening on
HOST:PORT`` banner).

How long a child may take to print its ready line: ``ready_timeout_s`` when the
owner gives one, else :data:`READY_ENV` (seconds) when set, else
:data:`READY_TIMEOUT_S` stretched by the machine's load (a child of kvbridge's
imports torch and NIXL first: over a minute at load average 25 on two cores). A
child that exits before it is ready fails the wait at once, whatever the deadline
(also when a grandchild keeps its stdout open).

Teardown never leaks: :meth:`ChildProcess.close` (also on ``__exit__`` and when
readiness fails) resumes a stopped child, asks it to end, kills it after a
grace period, joins the reader thread and closes every pipe and file.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import KVBridgeError

__all__ = [
    "READY_ENV",
    "READY_TIMEOUT_S",
    "ChildProcess",
    "LaunchError",
    "json_object",
    "listening_on",
    "ready_prefix",
    "ready_timeout",
]

ReadyTest = Callable[[str], "dict[str, Any] | None"]

READY = "READY "
READY_TIMEOUT_S = 120.0
"""The default wait for a ready line on an idle machine; :func:`ready_timeout` stretches it
up to :data:`MAX_LOAD_STRETCH` times while the machine is loaded."""
MAX_LOAD_STRETCH = 5.0
READY_ENV = "KVBRIDGE_READY_TIMEOUT_S"
"""Environment variable: the wait for a child's ready line in seconds (not stretched)."""
EXIT_POLL_S = 0.25
"""How often a wait for the ready line checks whether the child has exited."""

KILL_WAIT_S = 60.0
"""How long a SIGKILLed child may take to be gone: tearing down a big address space (a vLLM
engine with its KV cache and registered memory) took over 20 s on a 2-core machine short of
memory."""


class LaunchError(KVBridgeError, RuntimeError):
    """A child process exited, stayed silent or said something malformed before it was
    ready (a ``RuntimeError`` too: what ``demo``'s launchers raised before)."""


def ready_prefix(prefix: str = READY) -> ReadyTest:
    """Readiness is the first line ``PREFIX{json object}``; the object is the ready info."""

    def test(line: str) -> dict[str, Any] | None:
        if not line.startswith(prefix):
            return None
        info = json.loads(line[len(prefix) :])
        if not isinstance(info, dict):
            raise LaunchError(f"ready line is not a JSON object: {line!r}")
        return info

    return test


def json_object(line: str) -> dict[str, Any] | None:
    """Readiness is the first line that is a JSON object (``kvbridge serve``)."""
    if not line.startswith("{"):
        return None
    try:
        info = json.loads(line)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def listening_on(line: str) -> dict[str, Any] | None:
    """Readiness is a ``... listening on HOST:PORT[,] ...`` banner; info ``{"address",
    "banner"}``."""
    marker = " listening on "
    if marker not in line:
        return None
    rest = line.split(marker, 1)[1].split()
    return {"address": rest[0].rstrip(",") if rest else "", "banner": line}


def ready_timeout(base_s: float = READY_TIMEOUT_S) -> tuple[float, str]:
    """The default wait for a ready line and why it is that long: :data:`READY_ENV` if set,
    else ``base_s`` times the 1-minute load average per CPU (1 to
    :data:`MAX_LOAD_STRETCH`). LaunchError if the variable is not a positive number."""
    raw = os.environ.get(READY_ENV)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise LaunchError(
                f"{READY_ENV}={raw!r} must be a positive number of seconds (e.g. 300), "
                "or unset for the load-scaled default"
            )
        return value, f"from {READY_ENV}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    stretch = min(MAX_LOAD_STRETCH, max(1.0, load / max(1, cpus or 1)))
    return base_s * stretch, (
        f"{base_s:g}s x {stretch:.1f} for load average {load:.1f} on {cpus} CPU(s); "
        f"set {READY_ENV} to wait longer"
    )


class ChildProcess(Closing):
    """A started child; :meth:`wait_ready` (or ``with``) waits for its readiness line."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        ready: ReadyTest = ready_prefix(),  # noqa: B008 (a pure function, built once)
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        log: Path | None = None,
        stdin: bool = False,
        keep_stdout: bool = False,
        core: int | None = None,
        ready_timeout_s: float | None = None,
        ready_base_s: float = READY_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.ready_timeout_s = ready_timeout_s
        self.ready_base_s = ready_base_s
        """The idle-machine wait :func:`ready_timeout` stretches when no timeout is given."""
        self.info: dict[str, Any] | None = None
        self._test = ready
        self._keep_stdout = keep_stdout
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._log_path = log
        self._final_log: str | None = None
        self._log: IO[bytes] = (
            log.open("ab") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115
        )
        full_env = {**os.environ, "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")}
        full_env.update(env or {})
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._log,
                env=full_env,
                cwd=cwd,
                preexec_fn=_pin_to_core(core),
            )
        except BaseException:
            self._log.close()
            raise
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    # -- readiness ---------------------------------------------------------------------

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            for raw in iter(out.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                if self.info is None and self._error is None:
                    try:
                        self.info = self._test(line)
                    except Exception as exc:  # a malformed ready line: report it, stop
                        self._error = exc
                    if self.info is None and self._error is None:
                        self._tail.append(line)
                        continue
                    self._event.set()
                    if self._keep_stdout:
                        return  # the rest of stdout belongs to the owner
                else:
                    self._tail.append(line)
        except (OSError, ValueError):
            pass  # the pipe was closed under us by close()
        finally:
            self._event.set()

    def wait_ready(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The ready info; closes the child and raises :class:`LaunchError` if it exits,
        prints a malformed ready line, or says nothing within the deadline (``timeout_s``,
        else the one given at start, else :func:`ready_timeout`'s)."""
        if self.info is not None:
            return self.info
        timeout = self.ready_timeout_s if timeout_s is None else timeout_s
        why_long = ""
        if timeout is None:
            timeout, why_long = ready_timeout(self.ready_base_s)
        deadline = time.monotonic() + timeout
        while not self._event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._event.wait(min(EXIT_POLL_S, left)):
                break
            if self.proc.poll() is not None:  # exited, its stdout still open elsewhere
                self._event.wait(0.5)  # a ready line already in the pipe still counts
                break
        if self.info is not None:
            return self.info
        if self._event.is_set() and self._error is None:  # stdout ended: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        why = (
            f"printed a bad ready line ({self._error})"
            if self._error is not None
            else f"exited with {self.proc.poll()}"
            if self.proc.poll() is not None
            else f"was not ready after {timeout:g}s" + (f" ({why_long})" if why_long else "")
        )
        self.close(grace_s=0)
        raise LaunchError(f"{self.name} {why}: {' '.join(self.argv)}\n{self.log()[-3000:]}")

    @property
    def stdout(self) -> IO[bytes]:
        """The child's stdout after its ready line (only with ``keep_stdout=True``)."""
        assert self._keep_stdout and self.proc.stdout is not None
        return self.proc.stdout

    @property
    def stdin(self) -> IO[bytes]:
        assert self.proc.stdin is not None, "started without stdin=True"
        return self.proc.stdin

    # -- the process -------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP return only once every thread has stopped (delivery is
        asynchronous: a request sent right after it could otherwise still be served)."""
        self.proc.send_signal(sig)
        if sig != signal.SIGSTOP:
            return
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            if time.monotonic() > deadline:
                raise LaunchError(f"{self.name} (pid {self.proc.pid}) did not stop in 10s")
            time.sleep(0.005)

    def terminate(self) -> None:
        """Ask it to end (SIGTERM) without waiting; :meth:`close` waits."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def kill(self) -> None:
        """End it abruptly (also when stopped) and reap it."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=KILL_WAIT_S)

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM, up to ``grace_s`` to exit, then SIGKILL; close pipes, log and reader
        (idempotent; ``grace_s=0`` kills at once)."""
        if self.proc.poll() is None and grace_s > 0:
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._reader.join(timeout=10)
        if self._final_log is None:
            self._final_log = self.log()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # a broken pipe flushes with EPIPE
                self.proc.stdin.close()
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()  # (a grandchild may still hold it: then leave it be)
        if not self._log.closed:
            self._log.close()

    def log(self) -> str:
        """What the child wrote to stderr, and stdout lines that were not its protocol."""
        if self._final_log is not None:
            return self._final_log
        err = ""
        if self._log_path is not None:
            err = self._log_path.read_text(errors="replace")
        elif not self._log.closed:
            self._log.flush()
            self._log.seek(0)
            err = self._log.read().decode(errors="replace")
        out = "\n".join(self._tail)
        return err + (f"\n[stdout]\n{out}" if out else "")

    def __enter__(self) -> ChildProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.close(grace_s=0)
            raise
        return self

    def __repr__(self) -> str:
        return f"ChildProcess({self.name!r}, pid={self.proc.pid}, rc={self.proc.poll()})"


def _pin_to_core(core: int | None) -> Callable[[], None] | None:
    if core is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {core})

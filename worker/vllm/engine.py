"""Drive vLLM engines in the vLLM virtual environment from the main one (tests, benchmark).

:class:`Engine` starts :mod:`kvbridge.worker.vllm.instance` in ``.venv-vllm``
(:mod:`.venv`), pinned to one core, as a :class:`~kvbridge.worker.ChildProcess`
that is ready on its first ``KVB-JSON {"ready": true}`` line, and talks JSON
lines to it. vLLM is never imported here.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from kvbridge.worker.child import ChildProcess, LaunchError, ready_prefix
from kvbridge.worker.vllm.venv import PYTHON, ROOT

__all__ = ["PREFIX", "Engine", "kv_config", "running", "tokens"]

PREFIX = "KVB-JSON "
"""Answer lines of the instance start with this (vLLM logs to stdout too)."""


STARTUP_BASE_S = 240.0
"""An engine's wait for its ready line on an idle machine (stretched by load)."""

DRAIN_MARGIN_S = 30.0
"""How much longer than a ``drain``'s own deadline its answer is waited for."""


def kv_config(connector: str, role: str, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for kvbridge (``connector="kvbridge"``) or NixlConnector."""
    if connector == "kvbridge":
        return {
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.connector.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def pair_configs(
    connector: str, port: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, str]]:
    """The prefill's and the decode's ``--kv-transfer-config`` and environment for one
    connector of ``kvbridge bench vllm`` (``kvbridge``, ``kvbridge-blhnc``,
    ``kvbridge-noverify``: verification off on both, or ``nixl``), the prefill's side
    channel on ``port`` (NixlConnector's decode on ``port + 1``)."""
    if not connector.startswith("kvbridge"):
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
        d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 1)}
        return kv_config("nixl", "kv_producer"), kv_config("nixl", "kv_consumer"), p_env, d_env
    off = {"verify_loads": False} if connector == "kvbridge-noverify" else {}
    p_kv = kv_config("kvbridge", "kv_producer", control_port=port, **off)
    # the decode names its prefill, as a deployment that limits dialing does: it links to it
    # at start (kvbridge's early link), not at its first load
    d_kv = kv_config("kvbridge", "kv_consumer", allowed_peers=[f"127.0.0.1:{port}"], **off)
    return p_kv, d_kv, {}, {}


class Engine:
    """One vLLM engine process; use as a context manager (it is closed on exit)."""

    def __init__(
        self,
        model: Path,
        *,
        core: int,
        kv: dict[str, Any] | None = None,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float | None = None,
        wait: bool = True,
        log_stats: bool = False,
        max_model_len: int | None = None,
        cpu_kv_layouts: Sequence[str] = (),
        tp: int = 1,
        kv_events: dict[str, Any] | None = None,
        tokenizer: bool = False,
        llm_args: dict[str, Any] | None = None,
    ) -> None:
        """``cpu_kv_layouts`` (test-only shim): vLLM layout names the CPU attention
        backend is made to declare before the engine is built (``--cpu-kv-layouts``).
        ``kv_events``: vLLM's ``--kv-events-config``. ``tokenizer``: load the model's
        tokenizer (prompts are token ids either way; Whisper's processor needs one).
        ``llm_args``: more ``vllm.LLM`` keyword arguments (``--llm-args``).
        ``startup_timeout_s``: the wait for the engine's ready line; by default
        :data:`STARTUP_BASE_S` stretched by the machine's load (or ``KVBRIDGE_READY_TIMEOUT_S``,
        see :func:`kvbridge.worker.child.ready_timeout`)."""
        cmd = [str(PYTHON), "-m", "kvbridge.worker.vllm.instance", "--model", str(model)]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if cpu_kv_layouts:
            cmd += ["--cpu-kv-layouts", ",".join(cpu_kv_layouts)]
        if kv:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        if kv_events:
            cmd += ["--kv-events-config", json.dumps(kv_events)]
        if log_stats:
            cmd.append("--log-stats")
        if tokenizer:
            cmd.append("--tokenizer")
        if llm_args:
            cmd += ["--llm-args", json.dumps(llm_args)]
        if tp > 1:  # one worker process per rank, all pinned to ``core`` with the engine
            cmd += ["--tensor-parallel-size", str(tp)]
        self.log = log
        self.child = ChildProcess(
            cmd,
            name=f"vLLM engine on core {core}",
            ready=ready_prefix(PREFIX),
            env={
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                # vLLM's log lines (and kvbridge's, which follow them) into ``log``: stdout
                # carries the answers
                "VLLM_LOGGING_STREAM": "ext://sys.stderr",
                "PYTHONUNBUFFERED": "1",
                # this checkout's kvbridge in the engine and in every rank's worker process
                "PYTHONPATH": str(ROOT),
                **(env or {}),
            },
            cwd=ROOT,
            log=log,
            stdin=True,
            keep_stdout=True,
            core=core,
            ready_timeout_s=startup_timeout_s,
            ready_base_s=STARTUP_BASE_S,
        )
        self.ready: dict[str, Any] | None = None
        self._quit_sent = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict[str, Any]:
        """Block until the engine has started (start several with ``wait=False`` first)."""
        if self.ready is None:
            self.ready = self.child.wait_ready()
            if "error" in self.ready:
                raise LaunchError(f"vLLM engine failed to start: {self.ready['error']}")
        return self.ready

    def _read(self) -> dict[str, Any]:
        while line := self.child.stdout.readline().decode(errors="replace"):
            if line.startswith(PREFIX):
                answer: dict[str, Any] = json.loads(line[len(PREFIX) :])
                if "error" in answer:
                    raise RuntimeError(answer["error"])
                return answer
        raise RuntimeError(f"vLLM engine exited (rc={self.child.poll()}); see {self.log}")

    def call(self, timeout_s: float = 300.0, **cmd: Any) -> dict[str, Any]:
        """Send one command and read its answer; a child that stays silent for ``timeout_s``
        is killed (the read then ends) and :class:`TimeoutError` raised. A ``drain`` gets
        ``timeout_s`` as its own deadline (it then answers with what is still held) and is
        waited for :data:`DRAIN_MARGIN_S` longer, so a drain that runs to its deadline is
        answered, not killed (which would fail every later test sharing the engine)."""
        if cmd.get("cmd") == "drain":
            cmd.setdefault("timeout_s", timeout_s)
            timeout_s = float(cmd["timeout_s"]) + DRAIN_MARGIN_S
        self._send(cmd)
        return self._answer(timeout_s)

    def _send(self, cmd: dict[str, Any]) -> None:
        self.child.stdin.write((json.dumps(cmd) + "\n").encode())
        self.child.stdin.flush()

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        timer = threading.Timer(timeout_s, self.child.kill)
        timer.start()
        try:
            return self._read()
        except RuntimeError:
            if not timer.is_alive():
                raise TimeoutError(f"no answer from the vLLM engine in {timeout_s}s") from None
            raise
        finally:
            timer.cancel()

    def generate(
        self, prompts: list[list[int]], max_tokens: int, params: list[Any] | None = None
    ) -> dict[str, Any]:
        return self.call(cmd="generate", prompts=prompts, max_tokens=max_tokens, params=params)

    def kill(self) -> None:
        self.child.kill()

    def quit(self) -> None:
        """Ask a running engine to end without waiting for it (:meth:`close` waits), so that
        several engines shut down at once."""
        if self.child.poll() is None and self.ready is not None and not self._quit_sent:
            with suppress(OSError):
                self._send({"cmd": "quit"})
            self._quit_sent = True

    def close(self) -> None:
        """``quit`` (unless :meth:`quit` asked already), then whatever it takes: the process
        is gone afterwards."""
        if self.child.poll() is None and self.ready is not None:
            try:
                if not self._quit_sent:
                    self._send({"cmd": "quit"})
                    self._quit_sent = True
                self._answer(10)
                self.child.wait(20)
            except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                pass
        self.child.close(grace_s=0)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def running(engines: dict[str, Engine]) -> Iterator[dict[str, Engine]]:
    """Wait until every engine (started with ``wait=False``) is ready; close them all on exit."""
    try:
        for engine in engines.values():
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines.values():  # all shut down at once, then each is waited for
            engine.quit()
        for engine in engines.values():
            engine.close()


def tokens(answer: dict[str, Any]) -> list[list[int]]:
    """The generated token ids of a ``generate`` answer, one list per prompt."""
    return [o["tokens"] for o in answer["outputs"]]

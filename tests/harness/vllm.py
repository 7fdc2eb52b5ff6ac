"""The vLLM tests' common start: the ``.venv-vllm`` environment and the tiny models.

Both are made once per test session: checking the environment imports vLLM in a child
process and writing the model starts that venv's torch, ~10 s of CPU each, which every
vLLM test module would otherwise pay again.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker.vllm import (
    PYTHON,
    ROOT,
    Engine,
    VenvError,
    ensure_venv,
    kv_config,
    running,
    write_model,
)

_session: dict[str, Path | str] = {}
"""``"venv"``: the checked vLLM python, or ``"error"``: why there is none; ``"model"``: the
tiny Llama written by the first module that asked (it lives in pytest's session temp dir)."""


def venv_or_skip(tmp: Path) -> Path:
    """Build ``.venv-vllm`` if missing, checked once per session; skip the test without it.
    Returns its python."""
    if "venv" not in _session and "error" not in _session:
        try:
            _session["venv"] = ensure_venv(log=tmp / "venv.log")
        except VenvError as exc:
            _session["error"] = str(exc)
    if "error" in _session:
        pytest.skip(f"no vLLM environment: {_session['error']}")
    python = _session["venv"]
    assert isinstance(python, Path)
    return python


def model_or_skip(tmp: Path) -> Path:
    """:func:`venv_or_skip`, then write the tiny Llama under ``tmp`` (once per session;
    later calls get the first one); returns the model directory."""
    venv_or_skip(tmp)
    if "model" not in _session:
        _session["model"] = write_model(tmp / "model")
    model = _session["model"]
    assert isinstance(model, Path)
    return model


def write_tiny_model(kind: str, path: Path, seed: int = 0) -> Path:
    """A tiny model of another kind than Llama (:mod:`tests.harness.tiny_models`: ``gemma3``,
    ``gemma4``, ``mamba``, ``whisper``) under ``path``, written with the vLLM venv."""
    subprocess.run(
        [str(PYTHON), "-m", "tests.harness.tiny_models", kind, str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return path


def pd_trio(model: Path, tmp: Path, port: int, **common: Any) -> dict[str, Engine]:
    """A prefill (core 0, control ``port``), a decode (core 1) and a plain engine (core 1)
    of ``model``, started without waiting (pass them to :func:`running`); ``common`` goes
    to every :class:`Engine`."""
    return {
        "prefill": Engine(
            model,
            core=0,
            kv=kv_config("kvbridge", "kv_producer", control_port=port, lease_ttl_s=20),
            log=tmp / "prefill.log",
            **common,
        ),
        "decode": Engine(
            model,
            core=1,
            kv=kv_config("kvbridge", "kv_consumer", load_timeout_s=5),
            log=tmp / "decode.log",
            **common,
        ),
        "plain": Engine(model, core=1, log=tmp / "plain.log", **common),
    }


class Engines(dict[str, Engine]):
    """Running engines by name; an engine a test removed (``del engines[name]`` after killing
    it) is started again by its factory when a later test asks for it, so tests that kill
    one run in any order. ``close()`` closes what was started again."""

    def __init__(
        self, ready: dict[str, Engine], factories: dict[str, Callable[[], Engine]]
    ) -> None:
        super().__init__(ready)
        self._factories = factories
        self.restarted: list[Engine] = []

    def __missing__(self, key: str) -> Engine:
        if key not in self._factories:
            raise KeyError(key)
        engine = self._factories[key]()
        engine.wait_ready()
        self.restarted.append(engine)
        self[key] = engine
        return engine

    def close(self) -> None:
        for engine in self.restarted:
            engine.close()


@dataclass
class SharedPair:
    """The session's kvbridge prefill/decode pair on vLLM's CPU default layout (``LBHNC``:
    the connector asks for ``BLHNC`` and gets vLLM's fallback) and a plain engine, shared by
    the P/D and the layout tests, which need exactly these three."""

    engines: Engines
    port: int
    """The prefill's control port."""
    tmp: Path
    """Where the engines' logs are (``prefill-N.log``, ``decode.log``, ``plain.log``)."""


def shared_pair(tmp: Path) -> Iterator[SharedPair]:
    """Start the shared pair (see :class:`SharedPair`) under ``tmp``; close it after."""
    model = model_or_skip(tmp)
    port = 17000 + (hash(str(tmp)) % 2000)  # str hash: varies per run, that is the point
    starts = iter(range(100))

    def prefill() -> Engine:
        return Engine(
            model,
            core=0,
            kv=kv_config("kvbridge", "kv_producer", control_port=port, lease_ttl_s=20),
            log=tmp / f"prefill-{next(starts)}.log",
            wait=False,
        )

    started = {
        "prefill": prefill(),
        "decode": Engine(
            model,
            core=1,
            kv=kv_config("kvbridge", "kv_consumer", load_timeout_s=5),
            log=tmp / "decode.log",
            wait=False,
        ),
        "plain": Engine(model, core=0, log=tmp / "plain.log", wait=False),
    }
    with running(started) as ready:
        engines = Engines(ready, {"prefill": prefill})
        try:
            yield SharedPair(engines, port, tmp)
        finally:
            engines.close()


def daemon_stats(address: str) -> dict[str, Any]:
    """The offload daemon's ``Stats`` reply at ``address``, as a dict of its fields."""
    import grpc

    from kvbridge.proto import offload_pb2 as pb
    from kvbridge.proto import offload_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        resp = pb_grpc.OffloadStoreStub(channel).Stats(pb.StatsRequest(), timeout=10)
    return {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}


def metric(text: str, name: str, *, before: bool = False) -> float:
    """The one sample of ``name`` in a Prometheus scrape; 0 for a ``before`` snapshot taken
    before vLLM exported it (no load yet in this engine: the tests run in any order)."""
    values = [float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    if before and not values:
        return 0.0
    assert len(values) == 1, (name, values)
    return values[0]

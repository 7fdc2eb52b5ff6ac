"""The vLLM tests' common start: the vLLM environment (``.venv-vllm``, or the venv
``$KVBRIDGE_VLLM_VENV`` names), the tiny models and the engine sets the modules share.

Both are made once per test session: checking the environment imports vLLM in a child
process and writing the model starts that venv's torch, ~10 s of CPU each, which every
vLLM test module would otherwise pay again.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker.serving import start_offload_daemon
from kvbridge.worker.vllm import (
    PYTHON,
    ROOT,
    Engine,
    VenvError,
    ensure_venv,
    kv_config,
    running,
    tokens,
    write_model,
)

_session: dict[str, Path | str] = {}
"""``"venv"``: the checked vLLM python, or ``"error"``: why there is none; ``"model"``: the
tiny Llama written by the first module that asked (it lives in pytest's session temp dir)."""


def venv_or_skip(tmp: Path) -> Path:
    """Build ``.venv-vllm`` if missing (a ``$KVBRIDGE_VLLM_VENV`` venv is only checked),
    once per session; skip the test without it. Returns its python."""
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


def pd_trio(
    model: Path, tmp: Path, port: int, plain: bool = True, **common: Any
) -> dict[str, Engine]:
    """A kvbridge prefill (core 0, control ``port``), a decode (core 1) and, with ``plain``,
    a plain engine (core 1) of ``model``, started without waiting (pass them to
    :func:`running`); ``common`` goes to every :class:`Engine`."""
    engines = {
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
    }
    if plain:
        engines["plain"] = Engine(model, core=1, log=tmp / "plain.log", **common)
    return engines


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


def published_growth(
    engine: Engine, before: str, name: str, at_least: float
) -> Callable[[str], float]:
    """How much each of ``engine``'s metrics grew since the scrape ``before``, read once
    ``name`` grew by ``at_least``: vLLM publishes a step's connector stats with a later step,
    so an idle engine is stepped (up to 3 times) until they show."""
    after = engine.call(cmd="metrics")["text"]

    def grew(metric_name: str) -> float:
        return metric(after, metric_name) - metric(before, metric_name, before=True)

    for _ in range(3):
        if grew(name) >= at_least:
            break
        engine.generate([[1, 2, 3, 4]], 1)
        after = engine.call(cmd="metrics")["text"]
    return grew


def tp_trio(
    model: Path, tmp: Path, connector: str, port: int, ttl_s: float = 30, **common: Any
) -> dict[str, Engine]:
    """The TP engine trio of ``model`` through ``connector``, started without waiting (pass
    them to :func:`running`): a ``prefill`` at TP=2 (core 0), a ``decode`` at TP=2 (core 1;
    vLLM's stat loggers on: with TP > 1 its loads are read from vLLM's metrics) and a TP=1
    ``kv_both`` engine ``tp1`` (core 1): the reference, and the other side of the
    heterogeneous pairs. ``kvbridge``: the prefill serves control at ``port + rank``, the
    TP=1 engine at ``port + 100`` (leases of ``ttl_s``), and the decodes name their
    prefills (they link at start: a first load that makes its handshakes can outlast its
    deadline on a loaded machine). ``nixl``: side channels at ``port``, ``port + 2`` and
    ``port + 4``. ``common`` goes to every :class:`Engine`."""
    peers = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 100}"]
    if connector == "kvbridge":
        kv = {
            "prefill": kv_config("kvbridge", "kv_producer", control_port=port, lease_ttl_s=ttl_s),
            "decode": kv_config("kvbridge", "kv_consumer", load_timeout_s=20, allowed_peers=peers),
            "tp1": kv_config(
                "kvbridge",
                "kv_both",
                control_port=port + 100,
                lease_ttl_s=ttl_s,
                load_timeout_s=20,
                allowed_peers=peers[:1],
            ),
        }
        env: dict[str, dict[str, str]] = {name: {} for name in kv}
    else:
        roles = {"prefill": "kv_producer", "decode": "kv_consumer", "tp1": "kv_both"}
        kv = {name: kv_config("nixl", role) for name, role in roles.items()}
        offsets = {"prefill": 0, "decode": 2, "tp1": 4}
        env = {n: {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + o)} for n, o in offsets.items()}
    shapes = {"prefill": (0, 2), "decode": (1, 2), "tp1": (1, 1)}
    return {
        name: Engine(
            model,
            core=core,
            kv=kv[name],
            env=env[name],
            log=tmp / f"{name}.log",
            log_stats=tp > 1,
            tp=tp,
            **common,
        )
        for name, (core, tp) in shapes.items()
    }


def handed_over(prefill: Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """``prefill``'s ``kv_transfer_params`` for ``prompts`` (computed with one token each)."""
    pre = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p.get("remote_engine_id") for p in params), params
    return params


def pd_one_at_a_time(
    prefill: Engine, decode: Engine, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """P/D of ``prompts`` one request at a time (one load per request in the stats): the
    decode's tokens."""
    got: list[list[int]] = []
    for prompt in prompts:
        got += tokens(decode.generate([prompt], max_tokens, handed_over(prefill, [prompt])))
    return got


def pd_by_request(
    prefill: Engine, decode: Engine, prefix: str, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[dict[str, float]]]:
    """P/D of ``prompts`` one request at a time into a TP > 1 decode started with
    ``log_stats``; returns the tokens and, per request, the growth of the decode's
    ``vllm:<prefix>_*`` metrics over that request (all ranks' samples: ``loads``,
    ``bytes``, ``failed``, and for kvbridge ``blocks`` and ``failed_blocks``)."""
    names = {
        "loads": f"vllm:{prefix}_xfer_time_seconds_count",
        "bytes": f"vllm:{prefix}_bytes_transferred_sum",
        "failed": f"vllm:{prefix}_num_failed_transfers_total",
    }
    if prefix == "kvbridge":
        names["blocks"] = "vllm:kvbridge_num_blocks_sum"
        names["failed_blocks"] = "vllm:kvbridge_num_failed_blocks_total"
    got: list[list[int]] = []
    growth: list[dict[str, float]] = []
    for prompt in prompts:
        before = decode.call(cmd="metrics")["text"]
        params = handed_over(prefill, [prompt])
        got += tokens(decode.generate([prompt], max_tokens, params))
        after = decode.call(cmd="metrics")["text"]
        for _ in range(3):  # a step's stats leave with a later step
            if metric(after, names["loads"], before=True) > metric(
                before, names["loads"], before=True
            ):
                break
            decode.generate([[1, 2, 3, 4]], 1)
            after = decode.call(cmd="metrics")["text"]
        growth.append(
            {
                key: metric(after, name, before=True) - metric(before, name, before=True)
                for key, name in names.items()
            }
        )
    return got, growth


def nixl_tp_runs(
    model: Path,
    tmp: Path,
    port: int,
    prompts: dict[str, list[list[int]]],
    max_tokens: int,
    **common: Any,
) -> dict[str, Any]:
    """NixlConnector, the reference, on a fresh :func:`tp_trio` of ``model``: P/D of
    ``prompts["tp2"]`` at TP=2 -> TP=2 and of ``prompts["tp1_to_tp2"]`` and
    ``prompts["tp2_to_tp1"]``, one request at a time. Per pair its reference tokens (from
    an engine that is not its decode), tokens and transfers: the TP=2 decode's metric
    growth per request (:func:`pd_by_request`), the TP=1 decode's bytes per transfer and
    failures; and every engine's KV cache groups. The engines stop when this returns."""
    out: dict[str, Any] = {}
    with running(tp_trio(model, tmp, "nixl", port, **common)) as e:
        out["groups"] = {n: sorted(x.call(cmd="stats")["kv_cache_groups"]) for n, x in e.items()}
        for pair, prefill, decode, reference in (
            ("tp2", "prefill", "decode", "tp1"),
            ("tp1_to_tp2", "tp1", "decode", "tp1"),
            ("tp2_to_tp1", "prefill", "tp1", "decode"),
        ):
            batch = prompts[pair]
            out[f"expected_{pair}"] = tokens(e[reference].generate(batch, max_tokens))
            if decode == "decode":
                out[pair] = pd_by_request(e[prefill], e[decode], "nixl", batch, max_tokens)
                continue
            got = pd_one_at_a_time(e[prefill], e[decode], batch, max_tokens)
            stats = e[decode].call(cmd="stats")
            out[pair] = (got, stats["nixl_bytes"], stats["nixl_failed"])
    return out


def offload_pair(
    tmp: Path,
    model: str | Path,
    port: int,
    tp: int = 1,
    *,
    lease_ttl_s: float = 20,
    load_timeout_s: float = 10,
    max_model_len: int | None = 512,
    log_stats: Collection[str] | None = None,
    **llm_args: Any,
) -> Iterator[dict[str, Any]]:
    """An offload daemon and two ``kv_both`` engines with ``offload_address`` set: the
    ``writer`` (core 0, control at ``port``) and the ``reader`` (core 1, at ``port + tp``),
    at TP=``tp``. ``model``: a model directory (the tiny Llama of :func:`model_or_skip`) or
    the kind of tiny model to write (:func:`write_tiny_model`). ``log_stats``: the engines
    whose vLLM stat loggers are on (default: both at TP > 1); ``llm_args`` go to
    ``vllm.LLM``. Yields the engines and the ``daemon``."""
    venv_or_skip(tmp)
    if isinstance(model, str):
        model = write_tiny_model(model, tmp / model)
    stats = ("writer", "reader") if log_stats is None and tp > 1 else (log_stats or ())
    with start_offload_daemon(tmp, 60, "64MiB") as daemon:
        started = {
            name: Engine(
                model,
                core=core,
                kv=kv_config(
                    "kvbridge",
                    "kv_both",
                    control_port=port + tp * core,
                    offload_address=daemon.address,
                    lease_ttl_s=lease_ttl_s,
                    load_timeout_s=load_timeout_s,
                ),
                log=tmp / f"{name}.log",
                wait=False,
                max_model_len=max_model_len,
                startup_timeout_s=600.0,
                log_stats=name in stats,
                tp=tp,
                llm_args=llm_args or None,
            )
            for core, name in enumerate(("writer", "reader"))
        }
        with running(started) as ready:
            yield {**ready, "daemon": daemon}


def nixl_pair(model: Path, tmp: Path, port: int, **common: Any) -> dict[str, Engine]:
    """A NixlConnector ``prefill`` (core 0, side channel ``port``) and ``decode`` (core 1,
    ``port + 1``) of ``model``, started without waiting (pass them to :func:`running`);
    ``common`` goes to both :class:`Engine` s."""
    return {
        name: Engine(
            model,
            core=core,
            kv=kv_config("nixl", role),
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + core)},
            log=tmp / f"{name}.log",
            **common,
        )
        for name, core, role in (("prefill", 0, "kv_producer"), ("decode", 1, "kv_consumer"))
    }

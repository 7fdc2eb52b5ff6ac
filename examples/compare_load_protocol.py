"""Per-request KV transfer time of two kvbridge source trees, side by side in one run.

Runs ``kvbridge demo`` from each tree in turn (alternating, ``--runs`` times each,
so both see the same machine load) and compares the transfer time of requests
that moved 1 to 6 blocks from prefill, without each run's first request (it
pays the handshake). Typical use, comparing the load protocol of an older
commit with this checkout::

    git worktree add /tmp/kvb-before <commit>
    python examples/compare_load_protocol.py --before /tmp/kvb-before --out results/load-protocol

A tree is any checkout with the ``kvbridge/`` directory at its root (it goes on
``PYTHONPATH``). Writes ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def run_demo(tree: Path, requests: int, seed: int) -> list[float]:
    """Transfer times (ms) of one demo run's requests that moved 1..6 blocks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo.json"
        env = {**os.environ, "PYTHONPATH": str(tree), "UCX_MODULES": "^ib"}
        cmd = [sys.executable, "-m", "kvbridge.worker.cli", "demo", "--requests", str(requests)]
        cmd += ["--seed", str(seed), "--json", str(out)]
        subprocess.run(cmd, env=env, check=True, cwd=tmp, capture_output=True, text=True)
        rows = json.loads(out.read_text())["requests"]
    return [r["transfer_ms"] for r in rows[1:] if 1 <= r["blocks_moved"] <= 6]


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return {"n": len(values), "median_ms": statistics.median(values), "p90_ms": q[8]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="source tree to compare against")
    p.add_argument("--after", type=Path, default=HERE, help="source tree (default: this one)")
    p.add_argument("--runs", type=int, default=3, help="demo runs per tree (default 3)")
    p.add_argument("--requests", type=int, default=24, help="requests per run (default 24)")
    p.add_argument("--out", default="results/load-protocol", help="output prefix")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"before": [], "after": []}
    for run in range(args.runs):
        for side in ("before", "after"):
            got = run_demo(getattr(args, side), args.requests, seed=run)
            times[side] += got
            print(
                f"run {run + 1}/{args.runs} {side}: median {statistics.median(got):.3f} ms",
                file=sys.stderr,
            )
    result = {
        "before": {"tree": str(args.before), **summary(times["before"])},
        "after": {"tree": str(args.after), **summary(times["after"])},
        "loadavg": os.getloadavg(),
        "samples_ms": times,
    }
    saved = result["before"]["median_ms"] - result["after"]["median_ms"]  # type: ignore[operator]
    result["median_saved_ms"] = saved
    for side in ("before", "after"):
        s = result[side]
        print(f"{side:>6}: n={s['n']} median {s['median_ms']:.3f} ms, p90 {s['p90_ms']:.3f} ms")
    print(f"median saved per request: {saved:.3f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([times["before"], times["after"]], tick_labels=["before", "after"])
    ax.set_ylabel("transfer time per request (ms), 1-6 blocks")
    ax.set_title("KV load, loopback: before vs after")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``kvbridge bench hash``: how long naming a long prompt's blocks takes.

Target (issue: foundation): a 32k-token prompt at block size 16 in <= 1.5 ms
with SHA-256 on the 2-core CI machine.
"""

from __future__ import annotations

import argparse
import random
import time

from kvbridge.proto.hashing import HASH_ALGORITHMS, BlockHasher, HashConfig
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths
from kvbridge.worker.bench.report import bar_plot, print_table, write_json
from kvbridge.worker.cli_checks import positive_int

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("hash", help="time prefix-hashing of long prompts")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--repeats", type=positive_int, default=50, help="best of this many runs")
    add_output_arguments(p, "hash")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    rows = []
    for algorithm in HASH_ALGORITHMS:
        hasher = BlockHasher(b"bench", args.block_size, HashConfig(algorithm))
        for n in args.tokens:
            tokens = [rng.randrange(128_000) for _ in range(n)]
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                hasher.hash_blocks(tokens)
                times.append(time.perf_counter() - t0)
            times.sort()
            rows.append(
                {
                    "algorithm": algorithm,
                    "tokens": n,
                    "blocks": n // args.block_size,
                    "best_ms": times[0] * 1e3,
                    "median_ms": times[len(times) // 2] * 1e3,
                    "us_per_block": times[0] * 1e6 / max(1, n // args.block_size),
                }
            )
    print_table(rows, ["algorithm", "tokens", "blocks", "best_ms", "median_ms", "us_per_block"])
    target = next((r for r in rows if r["algorithm"] == "sha256" and r["tokens"] == 32768), None)
    if target is not None:
        verdict = "meets" if target["best_ms"] <= 1.5 else "misses"
        print(f"sha256, 32k tokens: {target['best_ms']:.3f} ms ({verdict} the 1.5 ms target)")
    json_path, png_path = output_paths(args.out)
    path = write_json(json_path, {"block_size": args.block_size, "rows": rows})
    labels = [str(n) for n in args.tokens]
    series = {a: [r["best_ms"] for r in rows if r["algorithm"] == a] for a in HASH_ALGORITHMS}
    bar_plot(png_path, "block hashing (best of runs)", labels, series, "ms")
    print(f"wrote {path} and {png_path}")
    return 0

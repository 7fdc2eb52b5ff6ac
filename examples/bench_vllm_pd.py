"""Side-by-side: the same vLLM P/D workload through kvbridge and vLLM's NixlConnector.

This example is now the command ``kvbridge bench vllm`` (:mod:`kvbridge.worker.bench.vllm`):
alternating fresh engine pairs, short and long prompts, the 4- and 8-layer tiny Llamas,
medians, spread and ratios in JSON and a plot. Arguments are passed through::

    python examples/bench_vllm_pd.py --rounds 1 --models 4L --out results/bench-vllm
"""

from __future__ import annotations

import sys

from kvbridge.worker.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "vllm", *sys.argv[1:]]))

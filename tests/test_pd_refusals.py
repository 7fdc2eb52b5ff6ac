"""A request whose prefill KV the decode planner refuses shows why and what it recomputed in
its per-request stats (it used to show an empty ``load_error`` and ``blocks_recomputed=0``).

Real prefill and decode nodes in separate processes; tokens compared with a single-process
engine.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvbridge.proto import codec
from kvbridge.worker.tools import check_no_leaks
from tests.harness.nodes import NodePair, node_args, reference

pytestmark = pytest.mark.slow

BS = 16
MAX_TOKENS = 4


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def test_a_refused_load_names_its_reason_and_counts_its_blocks(tmp_path: Path) -> None:
    theirs, mine = _prompt(40, 3 * BS + 4), _prompt(41, 3 * BS + 4)
    short = ["--lease-ttl", "3", "--load-timeout", "2"]  # the refused lease expires soon
    pair = NodePair(tmp_path, node_args(), prefill_extra=short)
    try:
        first = pair.prefill.generate(theirs, 1, "p", {"do_remote_decode": True})
        prompt = mine + list(first.token_ids)  # another prompt under prefill's params
        (expected,) = reference([prompt], MAX_TOKENS - 1)
        params = first.kv_transfer_params

        rest = pair.decode.generate(
            prompt, MAX_TOKENS - 1, "d", codec.unpack(params, "KVTransferParams")
        )
        assert list(rest.token_ids) == expected
        assert rest.stats.blocks_moved == 0
        assert rest.stats.load_error.startswith("not loaded: prefill's block hashes do not")
        assert rest.stats.blocks_recomputed == -(-len(prompt) // BS)
        # an honest request after it shows nothing of the refusal
        again = pair.router.generate(_prompt(42, 2 * BS + 1), MAX_TOKENS, "h")
        assert again.decode.load_error == "" and again.decode.blocks_recomputed == 0
        assert again.decode.blocks_moved == 3  # 33 tokens: two full blocks and a partial one
        assert check_no_leaks({"prefill": pair.prefill, "decode": pair.decode}) == []
    finally:
        pair.close()

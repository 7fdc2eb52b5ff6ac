"""Decode never reads KV on a router's word: the blocks' owner names them, and a lease that
lapses before the owner confirms the read means recompute.

Real prefill and decode nodes in separate processes; outputs compared token for token with a
single-process engine.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.proto import codec
from kvbridge.worker.tools import check_no_leaks
from tests.harness.nodes import NodePair, node_args, reference

pytestmark = pytest.mark.slow

BS = 16
MAX_TOKENS = 6


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def test_swapped_block_ids_under_a_valid_lease_load_the_owners_blocks(tmp_path: Path) -> None:
    a, b = _prompt(1, 5 * BS + 7), _prompt(2, 5 * BS + 7)
    expected_a, expected_b = reference([a, b], MAX_TOKENS)
    pair = NodePair(tmp_path, node_args())
    try:
        first_a = pair.prefill.generate(a, 1, "a", {"do_remote_decode": True})
        first_b = pair.prefill.generate(b, 1, "b", {"do_remote_decode": True})
        params: dict[str, Any] = codec.unpack(first_a.kv_transfer_params, "KVTransferParams")
        theirs = codec.unpack(first_b.kv_transfer_params, "KVTransferParams")
        assert params["block_ids"]["self"] != theirs["block_ids"]["self"]
        params["block_ids"] = theirs["block_ids"]  # a's lease and hashes, b's blocks
        rest = pair.decode.generate(a + list(first_a.token_ids), MAX_TOKENS - 1, "a", params)
        assert list(first_a.token_ids) + list(rest.token_ids) == expected_a
        # what decode cached under a's names is a's KV: an honest later request is right
        again = pair.router.generate(a, MAX_TOKENS, "a-again")
        assert again.tokens == expected_a and again.decode.blocks_local_hit > 0
        assert pair.router.generate(b, MAX_TOKENS, "b-again").tokens == expected_b
        assert check_no_leaks({"decode": pair.decode}) == []  # b's first lease just expires
    finally:
        pair.close()


def test_a_decode_stalled_past_the_lease_while_prefill_reuses_the_blocks_recomputes(
    tmp_path: Path,
) -> None:
    prompt = _prompt(3, 5 * BS + 7)
    fillers = [_prompt(100 + i, 6 * BS + 3) for i in range(9)]
    (expected,) = reference([prompt], MAX_TOKENS)
    prefill_extra = ["--lease-ttl", "1.0", "--load-timeout", "0.9"]
    decode_extra = [*prefill_extra, "--stall-before-read", "4.0"]
    pair = NodePair(
        tmp_path, node_args(num_blocks=48), prefill_extra=prefill_extra, decode_extra=decode_extra
    )
    try:
        first = pair.prefill.generate(prompt, 1, "s", {"do_remote_decode": True})
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        out: dict[str, Any] = {}

        def decode() -> None:
            out["rest"] = pair.decode.generate(
                prompt + list(first.token_ids), MAX_TOKENS - 1, "s", params
            )

        worker = threading.Thread(target=decode)
        worker.start()
        time.sleep(1.5)  # decode holds the owner's answer and sleeps; the lease lapses
        for i, filler in enumerate(fillers):  # prefill reuses every block it has
            pair.prefill.generate(filler, 1, f"f{i}", {})
        worker.join(60)
        assert not worker.is_alive()
        rest = out["rest"]
        assert list(first.token_ids) + list(rest.token_ids) == expected
        assert rest.stats.blocks_recomputed > 0 and rest.stats.load_error
        # nothing of the lapsed read was cached: an honest request is right too
        assert pair.router.generate(prompt, MAX_TOKENS, "s-again").tokens == expected
        assert check_no_leaks({"prefill": pair.prefill, "decode": pair.decode}) == []
    finally:
        pair.close()


def _loads_by_path(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        sample.labels["path"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvbridge_loads_total"
    }


def test_honest_loads_are_proven_by_the_seal_and_forged_ids_by_the_owner(tmp_path: Path) -> None:
    prompts = [_prompt(10 + i, BS * (1 + i % 6) + i) for i in range(6)]
    a, b = _prompt(20, 4 * BS + 3), _prompt(21, 4 * BS + 3)
    expected = reference([*prompts, a, b], MAX_TOKENS)
    extra = ["--metrics-port", "0"]
    pair = NodePair(tmp_path, node_args(), decode_extra=extra)
    try:
        for i, prompt in enumerate(prompts):  # 1 to 6 blocks each
            assert pair.router.generate(prompt, MAX_TOKENS, f"h{i}").tokens == expected[i]
        assert _loads_by_path(pair.info["decode"]["metrics"]) == {"sealed": 6.0, "owner": 0.0}
        # swapped ids: the seal does not hold, the owner names a's blocks
        first_a = pair.prefill.generate(a, 1, "a", {"do_remote_decode": True})
        first_b = pair.prefill.generate(b, 1, "b", {"do_remote_decode": True})
        params = codec.unpack(first_a.kv_transfer_params, "KVTransferParams")
        params["block_ids"] = codec.unpack(first_b.kv_transfer_params, "KVTransferParams")[
            "block_ids"
        ]
        rest = pair.decode.generate(a + list(first_a.token_ids), MAX_TOKENS - 1, "a", params)
        assert list(first_a.token_ids) + list(rest.token_ids) == expected[6]
        assert _loads_by_path(pair.info["decode"]["metrics"]) == {"sealed": 6.0, "owner": 1.0}
        # leases given back by notification (and by the owner path's release): only b's is left
        deadline = time.monotonic() + 10
        while pair.prefill.stats().active_leases > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pair.prefill.stats().active_leases == 1
        assert check_no_leaks({"decode": pair.decode}) == []
    finally:
        pair.close()


def test_a_forged_hop_naming_another_requests_lease_does_not_release_it(tmp_path: Path) -> None:
    victim, other = _prompt(30, 4 * BS + 5), _prompt(31, 4 * BS + 5)
    expected_victim, expected_other = reference([victim, other], MAX_TOKENS)
    pair = NodePair(tmp_path, node_args())
    try:
        first_v = pair.prefill.generate(victim, 1, "v", {"do_remote_decode": True})
        first_o = pair.prefill.generate(other, 1, "o", {"do_remote_decode": True})
        forged = codec.unpack(first_o.kv_transfer_params, "KVTransferParams")
        honest = codec.unpack(first_v.kv_transfer_params, "KVTransferParams")
        # other's prompt and hashes, but the victim's request and lease: the owner refuses it
        forged["request_id"], forged["lease_id"] = honest["request_id"], honest["lease_id"]
        rest = pair.decode.generate(other + list(first_o.token_ids), MAX_TOKENS - 1, "o", forged)
        assert list(first_o.token_ids) + list(rest.token_ids) == expected_other
        assert rest.stats.blocks_moved == 0
        assert pair.prefill.stats().active_leases == 2, "the forged hop released a lease"
        # the victim's own decode still reads every block of its lease
        rest = pair.decode.generate(victim + list(first_v.token_ids), MAX_TOKENS - 1, "v", honest)
        assert list(first_v.token_ids) + list(rest.token_ids) == expected_victim
        assert rest.stats.blocks_moved == 5 and rest.stats.blocks_recomputed == 0
    finally:
        pair.close()

"""A lease id the owner never issued in that spelling is refused by the seal check, the same
way its release would be: an upper-case id no longer loads by the seal and then leaves the
lease pinned until its TTL (its release notification was dropped).

Real prefill and decode nodes in separate processes (real NIXL); tokens compared with a
single-process engine.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvbridge.proto import codec
from kvbridge.worker.tools import check_no_leaks
from tests.harness.nodes import NodePair, node_args, reference

pytestmark = pytest.mark.slow

BS = 16
MAX_TOKENS = 4


def test_an_upper_case_lease_id_is_not_held_to_its_ttl(tmp_path: Path) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(1, 512) for _ in range(3 * BS + 2)]
    (expected,) = reference([prompt], MAX_TOKENS)
    # a lease TTL far beyond the check below: only a release can end the lease in time
    pair = NodePair(tmp_path, node_args(), prefill_extra=["--lease-ttl", "120"])
    try:
        first = pair.prefill.generate(prompt, 1, "u", {"do_remote_decode": True})
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        params["lease_id"] = params["lease_id"].upper()
        rest = pair.decode.generate(prompt + list(first.token_ids), MAX_TOKENS - 1, "u", params)
        assert list(first.token_ids) + list(rest.token_ids) == expected
        deadline = time.monotonic() + 10
        while pair.prefill.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pair.prefill.stats().active_leases == 0, "the lease was not released"
        assert check_no_leaks({"prefill": pair.prefill, "decode": pair.decode}) == []
    finally:
        pair.close()

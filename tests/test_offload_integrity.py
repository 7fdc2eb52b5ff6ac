"""Offload integrity with a real daemon and real NIXL workers: late and hostile WRITEs.

Registered memory is writable by anyone holding its NIXL metadata, and a WRITE
posted before a pause can land long after its store expired. These tests make
both happen with real processes (``kvbridge offload serve`` and
``offload_worker`` processes, each with its own NIXL agent) and check what a
reader gets: the bytes the committed store's writer wrote, or a counted
digest failure (recompute), never other bytes with no error.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from tests.harness.offload import DaemonProc, WorkerProc, start_workers

pytestmark = pytest.mark.slow

TINY_BLOCK = 2 * 4 * 16 * 2 * 32 * 4  # tiny preset: 2 x 4 layers x 16 tokens x 2 heads x 32 x fp32
IDS = [0, 1, 2, 3]
READ_IDS = [20, 21, 22, 23]


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def setup(
    worker: WorkerProc, address: str, seed: int, verify: bool = True, order: str = "block-nhd"
) -> None:
    worker.call(
        "setup",
        address=address,
        preset="tiny",
        num_blocks=32,
        order=order,
        seed=seed,
        verify=verify,
    )


def wait_for(worker: WorkerProc, what: str, ok: object) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 15
    while True:
        stats = worker.call("stats")["stats"]
        if ok(stats):  # type: ignore[operator]
            return stats  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"{what}: {stats}"
        time.sleep(0.1)


@pytest.fixture
def workers() -> Iterator[list[WorkerProc]]:
    procs = start_workers("late-w1", "late-w2", "late-reader")
    try:
        yield procs  # type: ignore[misc]
    finally:
        for p in procs:
            p.stop()


def _late_write_onto_committed_blocks(
    daemon: DaemonProc, w1: WorkerProc, w2: WorkerProc
) -> list[bytes]:
    """W1 prepares a store, pauses past its TTL; W2 stores and commits ``victim`` in the
    same slots; then W1's WRITE lands. Returns the victim hashes."""
    victim = hashes("victim", 4)
    prep = w1.call("prepare_store", hashes=hashes("w1", 4), ttl_s=0.5)
    assert len(prep["slots"]) == 4
    wait_for(w2, "W1's store expires", lambda s: s["writing_blocks"] == 0 and s["expired"] >= 1)
    stored = w2.call("store", ids=IDS, hashes=victim)
    assert (stored["stored"], stored["error"]) == (4, "")
    w1.call("write_slots", ids=IDS, slots=prep["slots"], store_id=prep["store_id"])
    return victim


def test_a_paused_writers_late_write_is_detected_recomputed_and_dropped(
    workers: list[WorkerProc],
) -> None:
    """Grace 0 (the old behaviour): W2 gets W1's expired slots, W1's late WRITE lands on
    W2's committed blocks; the reader sees the digest fail and loads nothing wrong."""
    w1, w2, reader = workers
    daemon = DaemonProc("--capacity", f"{4 * TINY_BLOCK}B", "--expired-grace", "0")
    try:
        for seed, w in enumerate(workers, 1):
            setup(w, daemon.address, seed)
        victim = _late_write_onto_committed_blocks(daemon, w1, w2)
        want = w2.call("blocks", ids=IDS)["blocks"]
        assert w1.call("blocks", ids=IDS)["blocks"] != want
        got = reader.call("load", ids=READ_IDS, hashes=victim)
        loaded = got["loaded"]
        # whatever the reader counts as loaded is W2's bytes; here all four are W1's
        assert reader.call("blocks", ids=READ_IDS[:loaded])["blocks"] == want[:loaded]
        assert (loaded, got["bad_digest"]) == (0, 4), got
        assert "digest" in got["error"]
        # the daemon recomputed the digests itself, agreed, and dropped the blocks
        stats = reader.call("stats")["stats"]
        assert (stats["bad_digest_reports"], stats["bad_digest_blocks"]) == (4, 4)
        assert reader.call("lookup", hashes=victim)["hits"] == 0
        # the slots came back: storing again works and then reads W2's bytes
        assert w2.call("store", ids=IDS, hashes=victim)["stored"] == 4
        again = reader.call("load", ids=READ_IDS, hashes=victim)
        assert (again["loaded"], again["bad_digest"]) == (4, 0)
        assert reader.call("blocks", ids=READ_IDS)["blocks"] == want
        for w in workers:
            w.call("close")
    finally:
        daemon.stop()


def test_the_grace_period_keeps_an_expired_stores_slots_out_of_reuse(
    workers: list[WorkerProc],
) -> None:
    """Default grace: W1's expired slots are not handed to W2, so its late WRITE lands in
    slots nobody uses and the reader gets W2's bytes, no digest failure."""
    w1, w2, reader = workers
    daemon = DaemonProc("--capacity", f"{16 * TINY_BLOCK}B")  # quarantines up to 4 slots
    try:
        for seed, w in enumerate(workers, 1):
            setup(w, daemon.address, seed)
        victim = hashes("victim", 4)
        prep = w1.call("prepare_store", hashes=hashes("w1", 4), ttl_s=0.5)
        stats = wait_for(w2, "W1's store expires", lambda s: s["writing_blocks"] == 0)
        assert stats["quarantined_blocks"] == 4
        stored = w2.call("store", ids=IDS, hashes=victim)
        assert stored["stored"] == 4
        w1.call("write_slots", ids=IDS, slots=prep["slots"], store_id=prep["store_id"])
        got = reader.call("load", ids=READ_IDS, hashes=victim)
        assert (got["loaded"], got["bad_digest"], got["error"]) == (4, 0, "")
        assert reader.call("blocks", ids=READ_IDS)["blocks"] == w2.call("blocks", ids=IDS)["blocks"]
        for w in workers:
            w.call("close")
    finally:
        daemon.stop()


def test_a_token_holder_writing_committed_blocks_is_caught_and_cannot_evict_by_claim(
    workers: list[WorkerProc],
) -> None:
    """Any session may pin blocks (learning their slots) and WRITE into them: readers
    catch it. A false 'bad' report evicts nothing: the daemon checks its own bytes."""
    owner, attacker, reader = workers
    daemon = DaemonProc("--capacity", f"{16 * TINY_BLOCK}B")
    try:
        for seed, w in enumerate(workers, 1):
            setup(w, daemon.address, seed)
        hs = hashes("honest", 4)
        assert owner.call("store", ids=IDS, hashes=hs)["stored"] == 4
        want = owner.call("blocks", ids=IDS)["blocks"]
        # a lying report about good blocks drops nothing
        pin = attacker.call("pin", hashes=hs)
        lie = attacker.call("unpin", load_id=pin["load_id"], bad=[0, 1, 2, 3])
        assert (lie["released"], lie["dropped"]) == (True, 0)
        assert reader.call("lookup", hashes=hs)["hits"] == 4
        # a WRITE of junk into blocks 2 and 3 is caught: 0 and 1 load, 2 and 3 recompute
        pin = attacker.call("pin", hashes=hs)
        attacker.call("write_slots", ids=[5, 6], slots=pin["slots"][2:])
        attacker.call("unpin", load_id=pin["load_id"], bad=[])
        got = reader.call("load", ids=READ_IDS, hashes=hs)
        assert (got["loaded"], got["bad_digest"]) == (2, 2), got
        assert reader.call("blocks", ids=READ_IDS[:2])["blocks"] == want[:2]
        stats = reader.call("stats")["stats"]
        assert (stats["bad_digest_reports"], stats["bad_digest_blocks"]) == (6, 2)
        assert reader.call("lookup", hashes=hs)["hits"] == 2
        for w in workers:
            w.call("close")
    finally:
        daemon.stop()


def test_with_verification_off_the_reader_trusts_the_daemons_memory() -> None:
    """The documented switch: no digest check, so a junk WRITE is loaded as if good (what
    every load did before digests). Shows the switch really turns the check off."""
    owner, attacker, reader = start_workers("off-owner", "off-attacker", "off-reader")
    daemon = DaemonProc("--capacity", f"{16 * TINY_BLOCK}B")
    try:
        setup(owner, daemon.address, 1)
        setup(attacker, daemon.address, 2)
        setup(reader, daemon.address, 3, verify=False)
        hs = hashes("unverified", 2)
        assert owner.call("store", ids=[0, 1], hashes=hs)["stored"] == 2
        pin = attacker.call("pin", hashes=hs)
        attacker.call("write_slots", ids=[0, 1], slots=pin["slots"])
        attacker.call("unpin", load_id=pin["load_id"], bad=[])
        got = reader.call("load", ids=[8, 9], hashes=hs)
        assert (got["loaded"], got["bad_digest"], got["error"]) == (2, 0, "")
        junk = attacker.call("blocks", ids=[0, 1])["blocks"]
        assert reader.call("blocks", ids=[8, 9])["blocks"] == junk
        for w in (owner, attacker, reader):
            w.call("close")
    finally:
        for w in (owner, attacker, reader):
            w.stop()
        daemon.stop()


def test_a_worker_in_another_inner_order_stores_and_loads_through_staging_verified(
    workers: list[WorkerProc],
) -> None:
    """A layer-hnd worker and a block-nhd pool (REARRANGE): blocks move through a staging
    cache in the pool's order, both ways, bit exact; digests are over the pool-order bytes,
    so a junk WRITE is caught on the staged path too."""
    nhd, hnd, attacker = workers
    daemon = DaemonProc("--capacity", f"{16 * TINY_BLOCK}B")
    try:
        setup(nhd, daemon.address, 1)  # the pool takes this worker's (NHD) order
        setup(hnd, daemon.address, 2, order="layer-hnd")
        setup(attacker, daemon.address, 3)
        a, b = hashes("from-nhd", 4), hashes("from-hnd", 4)
        assert nhd.call("store", ids=IDS, hashes=a)["stored"] == 4
        got = hnd.call("load", ids=READ_IDS, hashes=a)
        assert (got["loaded"], got["bad_digest"], got["error"]) == (4, 0, "")
        assert hnd.call("blocks", ids=READ_IDS)["blocks"] == nhd.call("blocks", ids=IDS)["blocks"]
        assert hnd.call("store", ids=[8, 9, 10, 11], hashes=b)["stored"] == 4
        got = nhd.call("load", ids=READ_IDS, hashes=b)
        assert (got["loaded"], got["bad_digest"]) == (4, 0)
        want = hnd.call("blocks", ids=[8, 9, 10, 11])["blocks"]
        assert nhd.call("blocks", ids=READ_IDS)["blocks"] == want
        pin = attacker.call("pin", hashes=b)
        attacker.call("write_slots", ids=[0], slots=pin["slots"][1:2])
        attacker.call("unpin", load_id=pin["load_id"], bad=[])
        got = hnd.call("load", ids=[24, 25, 26, 27], hashes=b)
        assert (got["loaded"], got["bad_digest"]) == (1, 1), got
        assert hnd.call("blocks", ids=[24])["blocks"] == want[:1]
        for w in workers:
            w.call("close")
    finally:
        daemon.stop()

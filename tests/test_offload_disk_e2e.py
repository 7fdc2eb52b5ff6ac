"""The offload daemon's disk tier end to end: a real daemon process with ``--disk``, real NIXL
worker processes, SIGKILL and restart, a block corrupted on disk, pins, bad flags."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.worker.offload import RECORD_BYTES, unpack_record
from tests.harness.offload import DaemonProc, WorkerProc, free_port, start_workers

pytestmark = pytest.mark.slow

TINY_BLOCK = 2 * 4 * 16 * 2 * 32 * 4  # tiny preset: 2 x 4 layers x 16 tokens x 2 heads x 32 x fp32
KVB = [sys.executable, "-m", "kvbridge.worker.cli"]


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def setup(worker: WorkerProc, address: str, seed: int) -> None:
    worker.call(
        "setup", address=address, preset="tiny", num_blocks=32, order="block-nhd", seed=seed
    )


def daemon(disk: Path, *, cpu: int = 4, on_disk: int = 16) -> tuple[DaemonProc, int]:
    port = free_port()
    d = DaemonProc(
        "--capacity", f"{cpu * TINY_BLOCK}B", "--disk", str(disk),
        "--disk-capacity", f"{on_disk * TINY_BLOCK}B", "--metrics-port", str(port),
    )  # fmt: skip
    return d, port


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"kvbridge_offload_(\w+) ([0-9.e+-]+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def store(w: WorkerProc, ids: list[int], hs: list[bytes]) -> None:
    got = w.call("store", ids=ids, hashes=hs)
    assert (got["stored"], got["error"]) == (len(hs), ""), got


def load(w: WorkerProc, ids: list[int], hs: list[bytes]) -> int:
    got = w.call("load", ids=ids, hashes=hs)
    assert got["bad_digest"] == 0, got  # the daemon checks disk blocks before serving
    return int(got["loaded"])


@pytest.fixture(scope="module")
def _worker_procs() -> Iterator[list[WorkerProc]]:
    procs = start_workers("disk-writer", "disk-reader", "disk-reader2")
    try:
        yield procs  # type: ignore[misc]
    finally:
        for p in procs:
            p.stop()


def reset(p: WorkerProc) -> None:
    """Close ``p``'s client and unregister its memory: its NIXL agent must then hold no
    link, registration or leaked transfer."""
    state = p.call("reset")
    assert (state["links"], state["memories"], state["leaked"]) == (0, 0, 0), (p.name, state)


@pytest.fixture
def workers(_worker_procs: list[WorkerProc]) -> Iterator[list[WorkerProc]]:
    """The module's three worker processes (one NIXL agent each), which every test sets up
    afresh against its own daemon; after the test each is reset (client closed, memory
    unregistered) and must hold no link, registration or leaked transfer."""
    for p in _worker_procs:
        reset(p)
    yield _worker_procs
    for p in _worker_procs:
        reset(p)


def test_evicted_blocks_go_to_disk_and_come_back_bit_exact(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    """A 4-block host pool under 12 stored blocks: 8 are demoted; loads promote them back
    (LRU across tiers), byte for byte the writer's."""
    w, reader, _ = workers
    d, port = daemon(tmp_path / "disk")
    try:
        setup(w, d.address, seed=1)
        setup(reader, d.address, seed=2)
        hs = hashes("tiers", 12)
        for i in range(0, 12, 4):
            store(w, list(range(i, i + 4)), hs[i : i + 4])
        m = metrics(port)
        assert (m["cached_blocks"], m["disk_blocks"], m["disk_demoted_blocks_total"]) == (4, 8, 8)
        assert m["disk_bytes"] == 8 * TINY_BLOCK and m["disk_capacity_blocks"] == 16
        assert reader.call("lookup", hashes=hs)["hits"] == 12  # both tiers
        want = w.call("blocks", ids=list(range(12)))["blocks"]
        for i in range(0, 12, 4):  # each load promotes 4, demoting the 4 the pool held
            assert load(reader, list(range(20, 24)), hs[i : i + 4]) == 4
            assert reader.call("blocks", ids=list(range(20, 24)))["blocks"] == want[i : i + 4]
        m = metrics(port)
        assert m["disk_promoted_blocks_total"] == 12
        assert m["disk_read_bytes_total"] == 12 * TINY_BLOCK
        assert m["disk_bad_digest_blocks_total"] == 0
        assert (m["cached_blocks"], m["disk_blocks"]) == (4, 8)
        for p in (w, reader):
            reset(p)
    finally:
        d.stop()


def test_a_sigkilled_daemon_restarts_serving_its_disk_and_never_a_corrupt_block(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    w, reader, reader2 = workers
    disk = tmp_path / "disk"
    d, _ = daemon(disk)
    hs = hashes("restart", 12)
    try:
        setup(w, d.address, seed=1)
        for i in range(0, 12, 4):
            store(w, list(range(i, i + 4)), hs[i : i + 4])
        want = w.call("blocks", ids=list(range(12)))["blocks"]
        reset(w)
    finally:
        d.kill()  # SIGKILL: no orderly shutdown
        d.stop()
    # corrupt block 5's bytes on disk (the slot its index record names)
    index = (disk / "index").read_bytes()
    records = [unpack_record(index[p : p + RECORD_BYTES]) for p in range(0, len(index), 128)]
    slots = {r[1][2:]: r[2] for r in records[1:] if r is not None and r[0] == 1}
    assert set(slots) == set(hs[:8])
    with open(disk / "slab", "r+b") as f:
        f.seek(slots[hs[5]] * TINY_BLOCK + 100)
        f.write(b"\xff" * 8)
    d, port = daemon(disk)
    try:
        # the pool is made at start from the layout kept on disk (no handshake needed: a
        # lookup-only client can hit at once); the host pool starts empty
        m = metrics(port)
        assert (m["disk_restored_blocks"], m["disk_blocks"], m["cached_blocks"]) == (8, 8, 0)
        setup(reader, d.address, seed=2)
        assert reader.call("lookup", hashes=hs)["hits"] == 8
        assert load(reader, list(range(20, 24)), hs[:4]) == 4
        assert reader.call("blocks", ids=list(range(20, 24)))["blocks"] == want[:4]
        # 4, then 5 fails the daemon's digest check: dropped, counted, the load stops there
        assert load(reader, list(range(20, 24)), hs[4:8]) == 1
        assert reader.call("blocks", ids=[20])["blocks"] == want[4:5]
        m = metrics(port)
        assert m["disk_bad_digest_blocks_total"] == 1
        assert reader.call("lookup", hashes=[hs[5]])["hits"] == 0
        assert load(reader, [21, 22], hs[6:8]) == 2
        assert reader.call("blocks", ids=[21, 22])["blocks"] == want[6:8]
        # a second reader process: 0..3 were demoted again meanwhile, promoted once more
        setup(reader2, d.address, seed=3)
        assert load(reader2, list(range(20, 24)), hs[:4]) == 4
        assert reader2.call("blocks", ids=list(range(20, 24)))["blocks"] == want[:4]
        for p in (reader, reader2):
            reset(p)
    finally:
        d.stop()


def test_pinned_blocks_are_never_demoted(tmp_path: Path, workers: list[WorkerProc]) -> None:
    """Two pinned blocks stay in the host pool while stores cycle the other two slots; after a
    SIGKILL only what was demoted is back: never the pinned blocks."""
    w, reader, reader2 = workers
    disk = tmp_path / "disk"
    d, port = daemon(disk)
    pinned, rest = hashes("pinned", 2), hashes("cycled", 6)
    try:
        setup(w, d.address, seed=1)
        setup(reader, d.address, seed=2)
        store(w, [0, 1], pinned)
        pin = reader.call("pin", hashes=pinned)
        assert len(pin["slots"]) == 2
        for i in range(0, 6, 2):
            store(w, [2 + i, 3 + i], rest[i : i + 2])
        m = metrics(port)
        assert (m["disk_demoted_blocks_total"], m["pinned_blocks"]) == (4, 2)
        assert w.call("lookup", hashes=pinned)["hits"] == 2
    finally:
        d.kill()
        d.stop()
    d, port = daemon(disk)
    try:
        setup(reader2, d.address, seed=3)
        assert reader2.call("lookup", hashes=rest[:4])["hits"] == 4
        assert reader2.call("lookup", hashes=pinned)["hits"] == 0
        reset(reader2)
    finally:
        d.stop()


def test_disk_lru_drops_the_least_recently_used_blocks(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    w, reader, _ = workers
    d, port = daemon(tmp_path / "disk", cpu=2, on_disk=4)
    hs = hashes("lru", 8)
    try:
        setup(w, d.address, seed=1)
        setup(reader, d.address, seed=2)
        for i in range(0, 6, 2):
            store(w, [i, i + 1], hs[i : i + 2])  # host: 4,5; disk: 0,1,2,3
        # promoting 0,1 demotes 4,5; the disk (0..3 listed, 0,1 being read) drops 2,3 (LRU)
        assert load(reader, [20, 21], hs[:2]) == 2
        store(w, [6, 7], hs[6:8])  # host: 6,7; 0,1 demoted into the slots they left
        assert reader.call("lookup", hashes=hs[2:3])["hits"] == 0
        assert reader.call("lookup", hashes=hs[4:6])["hits"] == 2
        assert reader.call("lookup", hashes=hs[:2])["hits"] == 2
        assert metrics(port)["disk_evicted_blocks_total"] == 2
        for p in (w, reader):
            reset(p)
    finally:
        d.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disk-capacity", "lots"], "--disk-capacity 'lots' is not a size"),
        (["--disk-capacity", "0"], "--disk-capacity '0' must be at least one byte"),
        # checked before the host pool is allocated; a small one all the same
        (
            ["--disk-capacity", "100B", "--model", "tiny", "--capacity", "1MiB"],
            "--disk-capacity of 100 bytes holds no",
        ),
        (["--disk", "/proc/kvbridge-disk"], "--disk '/proc/kvbridge-disk' is not a writable"),
    ],
)
def test_bad_disk_flags_are_one_line_errors_naming_the_flag(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    args = ["offload", "serve", "--disk", str(tmp_path / "d"), *flags]
    out = subprocess.run([*KVB, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr


# the live-daemon variant runs with -m extended: the restart variant is the stronger check (all
# of pass 2 served from disk after a SIGKILL), and a live daemon's demote/promote round trip
# is test_evicted_blocks_go_to_disk_and_come_back_bit_exact's
@pytest.mark.parametrize("restart", [pytest.param(False, marks=pytest.mark.extended), True])
def test_the_demo_offload_pass_with_a_small_pool_over_a_disk_tier(
    tmp_path: Path, restart: bool
) -> None:
    """`kvbridge demo --offload` with an 8-block host pool (the 12 requests' prompts need ~75
    blocks) over a disk tier: the second pass's fresh decode loads more blocks from the daemon
    than its host pool holds, every token right; with --offload-restart the daemon is
    SIGKILLed between the passes, so all it serves comes from its disk."""
    out = tmp_path / "demo.json"
    flags = ["--offload-capacity", "256KiB", "--offload-disk", str(tmp_path / "disk")]
    cmd = [*KVB, "demo", "--offload", *flags, "--requests", "12", "--json", str(out)]
    done = subprocess.run(
        [*cmd, *(["--offload-restart"] if restart else [])],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["summary"]["all_match"] and report["summary"]["leaks"] == []
    offloaded = sum(r["blocks_offloaded"] for r in report["requests"] if r["pass"] == 2)
    assert offloaded > 8, report["summary"]
    assert ("restarted" in done.stdout) == restart


def test_the_disk_tier_publishes_its_blocks_with_medium_storage(
    tmp_path: Path, workers: list[WorkerProc]
) -> None:
    """Demotions are `BlockStored` STORAGE (and `BlockRemoved` CPU); promotions the reverse;
    a restarted daemon announces what its disk still lists."""
    pytest.importorskip("zmq", reason="KV events need pyzmq (pip install kvbridge[events])")
    from kvbridge.connector.events import BlockRemoved, BlockStored, EventSubscriber

    w, reader, _ = workers
    pub, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/ev-replay"
    disk = tmp_path / "disk"
    hs = hashes("events", 8)

    def start() -> DaemonProc:
        return DaemonProc(
            "--capacity", f"{4 * TINY_BLOCK}B", "--disk", str(disk), "--kv-events", pub,
            "--kv-events-replay", replay,
        )  # fmt: skip

    def events(want: int) -> list[tuple[str, str, bytes]]:
        out: list[tuple[str, str, bytes]] = []
        deadline = time.monotonic() + 30
        with EventSubscriber(pub, replay_endpoint=replay, from_seq=0) as sub:
            while len(out) < want:
                assert time.monotonic() < deadline, out
                for r in sub.receive(timeout_s=0.1):
                    for e in r.batch.events:
                        if isinstance(e, BlockStored | BlockRemoved):
                            kind = type(e).__name__
                            out += [(kind, e.medium, bytes(x)) for x in e.block_hashes]  # type: ignore[arg-type]
        return out

    d = start()
    try:
        setup(w, d.address, seed=1)
        setup(reader, d.address, seed=2)
        store(w, [0, 1, 2, 3], hs[:4])
        store(w, [4, 5, 6, 7], hs[4:])  # demotes 0..3
        assert load(reader, [20, 21], hs[:2]) == 2  # promotes 0,1 (demoting two of 4..7)
        got = events(8 + 4 + 4 + 2 + 2 + 2 + 2)
        storage_in = {h for k, m, h in got if (k, m) == ("BlockStored", "STORAGE")}
        storage_out = {h for k, m, h in got if (k, m) == ("BlockRemoved", "STORAGE")}
        assert set(hs[:4]) <= storage_in and storage_out == set(hs[:2])
        assert {h for k, m, h in got if (k, m) == ("BlockRemoved", "CPU")} >= set(hs[:4])
        for p in (w, reader):
            reset(p)
    finally:
        d.kill()
        d.stop()
    d = start()
    try:
        got = events(4)
        assert {m for _, m, _ in got} == {"STORAGE"} and len({h for _, _, h in got}) == 4
        assert {h for _, _, h in got} == set(hs[2:4]) | (storage_in - set(hs[:4]))
    finally:
        d.stop()

"""The offload daemon with real worker processes and real NIXL: bytes, sharing, failures.

The daemon runs as ``kvbridge offload serve`` (via ``python -m``) and each
worker as ``offload_worker.py`` (an :class:`OffloadClient` over its own NIXL
transport), so a killed process is really gone. Every test stops its
processes in ``finally``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from tests.harness.offload import DaemonProc, WorkerProc, start_workers

pytestmark = pytest.mark.slow

TINY_BLOCK = 2 * 4 * 16 * 2 * 32 * 4  # tiny preset: 2 x 4 layers x 16 tokens x 2 heads x 32 x fp32


def hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def setup(worker: WorkerProc, address: str, order: str = "block-nhd", seed: int = 1) -> None:
    worker.call("setup", address=address, preset="tiny", num_blocks=32, order=order, seed=seed)


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[DaemonProc, WorkerProc, WorkerProc]]:
    """One daemon and two workers (block-outermost and layer-separate) for the module."""
    a, b = WorkerProc("offload-a"), WorkerProc("offload-b")  # start while the daemon starts
    d: DaemonProc | None = None
    try:
        d = DaemonProc("--capacity", f"{64 * TINY_BLOCK}B", "--metrics-port", "0")
        a.wait_ready()
        b.wait_ready()
        setup(a, d.address, seed=1)
        setup(b, d.address, order="layer-nhd", seed=2)  # PER_SPAN against the pool
        yield d, a, b
        a.call("close")
        b.call("close")
    finally:
        a.stop()
        b.stop()
        if d is not None:
            d.stop()


def test_blocks_round_trip_bit_exact_between_two_workers_sharing_a_daemon(
    node: tuple[DaemonProc, WorkerProc, WorkerProc],
) -> None:
    _, a, b = node
    hs = hashes("shared", 8)
    assert a.call("lookup", hashes=hs)["hits"] == 0
    stored = a.call("store", ids=list(range(8)), hashes=hs)
    assert (stored["stored"], stored["error"]) == (8, "")
    again = a.call("store", ids=list(range(8)), hashes=hs)
    assert (again["stored"], again["skipped"]) == (0, 8)
    assert b.call("lookup", hashes=[*hs, *hashes("other", 2)])["hits"] == 8
    loaded = b.call("load", ids=list(range(20, 28)), hashes=hs)
    assert (loaded["loaded"], loaded["error"]) == (8, "")
    want = a.call("blocks", ids=list(range(8)))["blocks"]
    assert b.call("blocks", ids=list(range(20, 28)))["blocks"] == want
    # and back into A's own memory after it lost the blocks
    a.call("scramble", ids=list(range(8)))
    assert a.call("load", ids=list(range(8)), hashes=hs)["loaded"] == 8
    assert a.call("blocks", ids=list(range(8)))["blocks"] == want
    stats = b.call("stats")["stats"]
    assert stats["stored_blocks"] == 8 and stats["loaded_blocks"] == 16
    assert stats["pinned_blocks"] == 0 and stats["writing_blocks"] == 0


def test_daemon_killed_and_restarted_is_a_miss_never_an_error() -> None:
    w = WorkerProc("offload-restart")
    d = DaemonProc("--capacity", f"{64 * TINY_BLOCK}B")
    port = d.port
    try:
        w.wait_ready()
        setup(w, d.address)
        hs = hashes("restart", 4)
        assert w.call("store", ids=[0, 1, 2, 3], hashes=hs)["stored"] == 4
        d.kill()
        assert w.call("lookup", hashes=hs)["hits"] == 0
        lost = w.call("load", ids=[8, 9, 10, 11], hashes=hs)
        assert lost["loaded"] == 0 and lost["error"]
        assert w.call("store", ids=[0, 1, 2, 3], hashes=hs)["stored"] == 0
        d.stop()
        d = DaemonProc("--capacity", f"{64 * TINY_BLOCK}B", port=port)
        time.sleep(0.3)  # the client's reconnect backoff
        assert w.call("lookup", hashes=hs)["hits"] == 0  # a new, empty daemon
        deadline = time.monotonic() + 10
        while (again := w.call("store", ids=[0, 1, 2, 3], hashes=hs))["stored"] != 4:
            assert time.monotonic() < deadline, again["error"]
            time.sleep(0.3)
        assert w.call("load", ids=[8, 9, 10, 11], hashes=hs)["loaded"] == 4
        blocks = w.call("blocks", ids=[0, 1, 2, 3, 8, 9, 10, 11])["blocks"]
        assert blocks[:4] == blocks[4:]
        w.call("close")
    finally:
        w.stop()
        d.stop()


def test_worker_killed_mid_store_leaves_no_block_visible(
    node: tuple[DaemonProc, WorkerProc, WorkerProc],
) -> None:
    daemon, _, reader = node
    (writer,) = start_workers("offload-writer")
    try:
        setup(writer, daemon.address, seed=3)
        hs = hashes("half", 4)
        slots = writer.call("begin_store", ids=[0, 1, 2, 3], hashes=hs, ttl_s=1.0)["slots"]
        assert len(slots) == 4
        writer.stop()  # SIGKILL: no commit, no abort
        assert reader.call("lookup", hashes=hs)["hits"] == 0
        assert reader.call("load", ids=[0, 1, 2, 3], hashes=hs)["loaded"] == 0
        # the dead writer's slots come back when its store expires; then the hashes store fine
        deadline = time.monotonic() + 10
        while (stats := reader.call("stats")["stats"])["writing_blocks"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert stats["expired"] >= 1
        assert reader.call("store", ids=[0, 1, 2, 3], hashes=hs)["stored"] == 4
        assert reader.call("lookup", hashes=hs)["hits"] == 4
    finally:
        writer.stop()


def test_metrics_endpoint_serves_prometheus_text(
    node: tuple[DaemonProc, WorkerProc, WorkerProc],
) -> None:
    import re

    daemon = node[0]
    import urllib.request

    m = re.search(r"metrics on :(\d+)/metrics", daemon.banner)
    assert m is not None, daemon.banner
    with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=5) as resp:
        body = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE kvbridge_offload_hits_total counter" in body
    assert "kvbridge_offload_store_latency_seconds_count" in body

"""KV events from real processes: ``kvbridge offload serve --kv-events`` under a real NIXL
worker, and ``kvbridge serve --kv-events`` prefill nodes that a router places requests on.

Subscribers are real ZMQ sockets in the test process (``ipc://`` endpoints in its temp dir).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvbridge.connector.events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventSubscriber,
)
from kvbridge.proto import BlockHasher
from kvbridge.worker.engine import EngineConfig
from kvbridge.worker.serving import EngineClient, EventPlacement, Router, start_node
from tests.harness.nodes import node_args, reference
from tests.harness.offload import DaemonProc, WorkerProc

pytest.importorskip("zmq", reason="KV events need pyzmq (pip install kvbridge[events])")
pytestmark = pytest.mark.slow

TINY_BLOCK = 2 * 4 * 16 * 2 * 32 * 4  # tiny preset block bytes (see test_offload_e2e)


def gather(sub: EventSubscriber, done: object, timeout_s: float = 30.0) -> list[EventBatch]:
    """Batches until ``done(batches)`` is true."""
    got: list[EventBatch] = []
    deadline = time.monotonic() + timeout_s
    while not done(got):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"gave up after {len(got)} batches"
        got.extend(r.batch for r in sub.receive(timeout_s=0.1))
    return got


def split(batches: Sequence[EventBatch]) -> tuple[list[bytes | int], list[bytes | int]]:
    events = [e for b in batches for e in b.events]
    put = [x for e in events if isinstance(e, BlockStored) for x in e.block_hashes]
    gone = [x for e in events if isinstance(e, BlockRemoved) for x in e.block_hashes]
    return put, gone


def test_daemon_publishes_every_store_and_eviction_a_worker_causes(tmp_path: Path) -> None:
    pub, replay = f"ipc://{tmp_path}/daemon", f"ipc://{tmp_path}/daemon-replay"
    worker = WorkerProc("events-w")
    daemon: DaemonProc | None = None
    try:
        daemon = DaemonProc(
            "--capacity", f"{8 * TINY_BLOCK}B", "--kv-events", pub, "--kv-events-replay", replay
        )
        assert f"KV events on {pub}" in daemon.banner
        with EventSubscriber(pub, replay_endpoint=replay, from_seq=0) as sub:
            worker.wait_ready()
            worker.call(
                "setup", address=daemon.address, preset="tiny", num_blocks=32,
                order="block-nhd", seed=1,
            )  # fmt: skip
            stored: list[bytes] = []
            evicted: list[bytes] = []
            for r in range(4):  # 4 x 6 blocks through an 8-block pool
                hs = [hashlib.sha256(f"r{r}-{i}".encode()).digest() for i in range(6)]
                out = worker.call("store", ids=list(range(6)), hashes=hs)
                assert out["error"] == "" and out["stored"] == 6
                stored += hs
                evicted += out["evicted"]
            stats = worker.call("stats")["stats"]
            assert stats["stored_blocks"] == 24 and stats["evicted_blocks"] == 16

            def complete(got: list[EventBatch]) -> bool:
                put, gone = split(got)
                return len(put) >= stats["stored_blocks"] and len(gone) >= len(evicted)

            batches = gather(sub, complete)
            assert sub.missed == 0
        worker.call("close")
    finally:
        worker.stop()
        if daemon is not None:
            daemon.stop()
    put, gone = split(batches)
    assert put == stored and len(put) == stats["stored_blocks"]
    assert sorted(gone) == sorted(evicted) and len(gone) == stats["evicted_blocks"]
    events = [e for b in batches for e in b.events]
    assert events[0] == AllBlocksCleared()  # the pool starts empty, and says so
    assert {e.medium for e in events[1:]} == {MEDIUM_CPU}  # type: ignore[union-attr]
    assert {e.block_size for e in events if isinstance(e, BlockStored)} == {16}


def test_router_prefers_the_prefill_node_whose_events_hold_the_prompt(tmp_path: Path) -> None:
    args = node_args(num_blocks=64)
    hasher = BlockHasher(EngineConfig.preset("tiny", block_size=16).layout().fingerprint(), 16)
    prompt = [(7 * i) % 250 + 1 for i in range(80)]  # 5 full blocks
    other = [(11 * i) % 250 + 1 for i in range(80)]
    with ExitStack() as stack:
        streams = []
        prefills = []
        for i in range(2):
            ev = (f"ipc://{tmp_path}/p{i}", f"ipc://{tmp_path}/p{i}-replay")
            extra = ["--kv-events", ev[0], "--kv-events-replay", ev[1]]
            _, info = stack.enter_context(
                start_node(f"prefill{i}", args, "block-nhd", tmp_path, None, extra, role="prefill")
            )
            assert info["kv_events"] == ev[0]
            streams.append(ev)
            prefills.append(EngineClient(info["inference"], timeout_s=60))
            stack.callback(prefills[-1].close)
        _, dinfo = stack.enter_context(start_node("decode", args, "block-nhd", tmp_path, None))
        decode = EngineClient(dinfo["inference"], timeout_s=60)
        stack.callback(decode.close)
        placement = stack.enter_context(EventPlacement(streams, hasher.hash_blocks))
        router = Router(prefills, decode, placement=placement)

        assert placement.prefer(prompt) is None  # nothing cached anywhere yet
        first = router.generate(prompt, 4, "a")  # round robin: prefill 0
        assert first.prefill_address == prefills[0].address
        # the node's stored events may come in more than one batch: wait for all 4 blocks
        # (preferring node 0 needs only the first)
        deadline, hashes = time.monotonic() + 30, hasher.hash_blocks(prompt)
        while placement.prefer(prompt) != 0 or placement.index.prefix_len("0", hashes) < 4:
            assert time.monotonic() < deadline, placement.index.nodes()
            time.sleep(0.05)
        # round robin alone would now pick prefill 1; the events send it back to 0
        again = router.generate(prompt[:72], 4, "b")
        assert again.prefill_address == prefills[0].address
        assert again.prefill.blocks_local_hit == 4
        # a prompt nobody holds still goes round robin
        fresh = router.generate(other, 4, "c")
        assert fresh.prefill_address == prefills[1].address
        expected = reference([prompt, prompt[:72], other], 4)
        assert [first.tokens, again.tokens, fresh.tokens] == expected


def test_subscriber_example_demo_prints_a_map_equal_to_the_engine_cache() -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "kv_events_subscriber.py"
    out = subprocess.run(
        [sys.executable, str(example), "--demo"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "engine GPU" in out.stdout and out.stdout.rstrip().endswith("match")

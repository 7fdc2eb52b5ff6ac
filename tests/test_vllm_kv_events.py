"""kvbridge's KV event bytes read by vLLM 0.32's own msgspec classes, in ``.venv-vllm``.

The check runs as a script in the vLLM environment (the main one never imports vLLM):
vLLM's ``KVEventBatch`` decoder reads kvbridge's ``vllm`` wire, re-encoding gives the very
same bytes, the same events built with vLLM's classes encode to those bytes, a live
kvbridge publisher's messages decode there too, and vLLM's ``KVEventsConfig`` fields are
a valid kvbridge config, and the connector's relay of the offload daemon's events hands
vLLM structs that its publisher encodes into the same wire.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from kvbridge.worker.vllm import VenvError, ensure_venv

pytestmark = pytest.mark.vllm

SCRIPT = r"""
import dataclasses, sys, time
import msgspec, zmq
from vllm.config.kv_events import KVEventsConfig as VllmConfig
from vllm.distributed import kv_events as v
from kvbridge.connector import events as k

h = [bytes([i]) * 32 for i in range(4)]
ours = k.EventBatch(
    1700000000.25,
    (
        k.BlockStored((h[1], h[2]), h[0], (1, 2, 3, 4), 2, None, k.MEDIUM_GPU, None, 0),
        k.BlockStored((h[3],), None, (), 16, None, k.MEDIUM_CPU, None),
        k.BlockRemoved((h[1],), k.MEDIUM_GPU, 0),
        k.BlockRemoved((h[2], h[3]), k.MEDIUM_CPU),
        k.AllBlocksCleared(),
    ),
    0,
)
payload = k.encode_batch(ours, k.WIRE_VLLM)
decoded = msgspec.msgpack.Decoder(v.KVEventBatch).decode(payload)
assert [type(e).__name__ for e in decoded.events] == [
    "BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared"
], decoded
first = decoded.events[0]
assert (first.block_hashes, first.parent_block_hash) == ([h[1], h[2]], h[0])
assert first.token_ids == [1, 2, 3, 4]
assert (first.block_size, first.medium, first.group_idx, first.lora_id) == (2, "GPU", 0, None)
assert decoded.events[3].medium == "CPU" and decoded.events[3].group_idx is None
assert decoded.data_parallel_rank == 0 and decoded.ts == 1700000000.25
assert msgspec.msgpack.encode(decoded) == payload, "re-encoding changed the bytes"
theirs = v.KVEventBatch(
    ts=1700000000.25,
    events=[
        v.BlockStored(block_hashes=[h[1], h[2]], parent_block_hash=h[0], token_ids=[1, 2, 3, 4],
                      block_size=2, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
        v.BlockStored(block_hashes=[h[3]], parent_block_hash=None, token_ids=[], block_size=16,
                      lora_id=None, medium="CPU", lora_name=None),
        v.BlockRemoved(block_hashes=[h[1]], medium="GPU", group_idx=0),
        v.BlockRemoved(block_hashes=[h[2], h[3]], medium="CPU"),
        v.AllBlocksCleared(),
    ],
    data_parallel_rank=0,
)
assert msgspec.msgpack.encode(theirs) == payload, "vLLM encodes the same events differently"
assert k.decode_batch(msgspec.msgpack.encode(theirs)) == ours
media = (k.MEDIUM_GPU, k.MEDIUM_CPU, k.MEDIUM_STORAGE)
assert (v.MEDIUM_GPU, v.MEDIUM_CPU, v.MEDIUM_STORAGE) == media

config = k.KVEventsConfig.from_dict(dataclasses.asdict(VllmConfig(
    enable_kv_cache_events=True, endpoint=f"ipc://{sys.argv[1]}/pub",
    replay_endpoint=f"ipc://{sys.argv[1]}/replay", topic="kv@pod@tiny",
)))
with k.ZmqEventPublisher(config) as pub:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod@")
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + 20
    frames = None
    while frames is None:
        assert time.monotonic() < deadline, "no message"
        pub.publish(ours.events)
        if sub.poll(100):
            frames = sub.recv_multipart()
    topic, seq, live = frames
    batch = msgspec.msgpack.Decoder(v.KVEventBatch).decode(live)
    assert topic == b"kv@pod@tiny" and len(seq) == 8
    names = [type(e).__name__ for e in batch.events][:5]
    assert names == [type(e).__name__ for e in decoded.events]
    sub.close(linger=0)
    ctx.term()
# the connector's relay hands vLLM its own structs: vLLM's publisher encodes them, kvbridge
# (and any vLLM consumer) reads medium CPU back
from types import SimpleNamespace
from kvbridge.connector.vllm.connector import _offload_relay, _to_vllm
from kvbridge.connector.vllm.config import VllmConnectorConfig
relayed = [
    _to_vllm(k.BlockStored((h[1],), None, (), 16, None, k.MEDIUM_CPU, None)),
    _to_vllm(k.BlockRemoved((h[1],), k.MEDIUM_CPU)),
]
batch = v.KVEventBatch(ts=2.0, events=relayed, data_parallel_rank=0)
back = k.decode_batch(msgspec.msgpack.encode(batch))
assert back.events == (
    k.BlockStored((h[1],), None, (), 16, None, "CPU", None),
    k.BlockRemoved((h[1],), "CPU"),
), back
cfg = VllmConnectorConfig.from_vllm("kv_consumer", "e", {"offload_kv_events": "ipc:///x"}, "m")
try:
    _offload_relay(cfg, SimpleNamespace(kv_events_config=VllmConfig()))
except Exception as exc:
    assert "kv-events-config" in str(exc), exc
else:
    raise AssertionError("relaying with vLLM's events off must be a config error")
print("ok", len(payload))
"""


def test_vllm_decodes_kvbridge_event_batches_and_reencodes_the_same_bytes(tmp_path: Path) -> None:
    try:
        python = ensure_venv(log=tmp_path / "venv.log")
    except VenvError as exc:
        pytest.skip(f"no vLLM environment: {exc}")
    out = subprocess.run(
        [str(python), "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith("ok ")


@pytest.mark.slow
@pytest.mark.extended  # a real engine and daemon (~1.5 min): kept out of the default CI run
@pytest.mark.timeout(900)
def test_vllm_publishes_the_offload_daemons_blocks_on_its_own_event_stream(
    tmp_path: Path,
) -> None:
    """A real vLLM engine (kvbridge connector, ``offload_kv_events``) and a real daemon
    (``--kv-events``): the blocks the daemon announces come out on vLLM's own stream with
    medium CPU next to vLLM's GPU events, and kvbridge's decoder reads vLLM's bytes."""
    pytest.importorskip("zmq", reason="KV events need pyzmq (pip install kvbridge[events])")
    from kvbridge.connector.events import MEDIUM_CPU, MEDIUM_GPU, BlockStored, EventSubscriber
    from kvbridge.worker import vllm as harness
    from tests.harness.offload import DaemonProc, free_port
    from tests.harness.vllm import model_or_skip

    model = model_or_skip(tmp_path)
    d_pub, d_replay = f"ipc://{tmp_path}/daemon", f"ipc://{tmp_path}/daemon-replay"
    v_pub, v_replay = f"ipc://{tmp_path}/vllm", f"ipc://{tmp_path}/vllm-replay"
    prompt = [5, *range(10, 110)]  # 101 tokens: 3 full 32-token blocks
    daemon = DaemonProc(
        "--capacity", "64MiB", "--kv-events", d_pub, "--kv-events-replay", d_replay
    )  # fmt: skip
    try:
        kv = harness.kv_config(
            "kvbridge",
            "kv_both",
            control_port=free_port(),
            offload_address=daemon.address,
            offload_kv_events=d_pub,
            offload_kv_events_replay=d_replay,
        )
        events = {
            "enable_kv_cache_events": True,
            "endpoint": v_pub,
            "replay_endpoint": v_replay,
            "topic": "kv@pod@tiny",
        }
        with (
            EventSubscriber(d_pub, replay_endpoint=d_replay, from_seq=0) as dsub,
            harness.Engine(
                model, core=0, kv=kv, kv_events=events, log=tmp_path / "vllm.log"
            ) as engine,
        ):
            engine.generate([prompt], 4)  # computed, then its full blocks stored in the daemon
            daemon_stored: set[bytes | int] = set()
            deadline = time.monotonic() + 120
            while len(daemon_stored) < 3:
                assert time.monotonic() < deadline, daemon.log()[-3000:]
                for got in dsub.receive(timeout_s=0.2):
                    for e in got.batch.events:
                        if isinstance(e, BlockStored):
                            daemon_stored.update(e.block_hashes)
            media: dict[str | None, set[bytes | int]] = {}
            with EventSubscriber(v_pub, replay_endpoint=v_replay, from_seq=0) as vsub:
                while not daemon_stored <= media.get(MEDIUM_CPU, set()):
                    assert time.monotonic() < deadline, media
                    engine.generate([[7, 8, 9]], 1)  # scheduler steps drain the relay
                    for got in vsub.receive(timeout_s=0.2):
                        assert got.topic == "kv@pod@tiny"
                        for e in got.batch.events:
                            if isinstance(e, BlockStored):
                                media.setdefault(e.medium, set()).update(e.block_hashes)
            assert media.get(MEDIUM_GPU), "vLLM's own cache events are on the same stream"
    finally:
        daemon.stop()

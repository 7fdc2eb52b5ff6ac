"""KV events: the wire shapes, the ZMQ publisher with replay, and the block pools' events.

The publisher and subscribers are real ZMQ sockets (``ipc://`` under the test's temp dir);
the pools are the real ``BlockPool`` and ``HostPool``.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from kvbridge.connector.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    WIRE_LLMD,
    WIRE_VLLM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventSubscriber,
    KVEventsConfig,
    KVEventsError,
    KVEventSource,
    PrefixIndex,
    ReceivedBatch,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    external_hash,
    llmd_topic,
)
from kvbridge.proto import ConfigError

zmq = pytest.importorskip("zmq", reason="KV events need pyzmq (pip install kvbridge[events])")


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def sample_batch() -> EventBatch:
    stored = BlockStored((h(1), h(2)), h(0), (5, 6, 7, 8), 2, None, MEDIUM_GPU, None, 0)
    return EventBatch(1234.5, (stored, BlockRemoved((h(1),), MEDIUM_GPU), AllBlocksCleared()), 0)


def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def collect(sub: EventSubscriber, want: int, timeout_s: float = 10.0) -> list[EventBatch]:
    """Batches from ``sub`` until they hold ``want`` events."""
    got: list[EventBatch] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(b.events) for b in got) < want:
        assert time.monotonic() < deadline, f"{sum(len(b.events) for b in got)} of {want} events"
        got.extend(r.batch for r in sub.receive(timeout_s=0.1))
    return got


# ------------------------------------------------------------------ the wire


def test_vllm_wire_is_an_array_batch_of_tagged_maps_with_vllm_field_names() -> None:
    body = msgpack.unpackb(encode_batch(sample_batch(), WIRE_VLLM), raw=False)
    ts, events, rank = body
    assert (ts, rank) == (1234.5, 0)
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [h(1), h(2)],
        "parent_block_hash": h(0),
        "token_ids": [5, 6, 7, 8],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    assert next(iter(events[0])) == "type"  # msgspec writes the tag first
    # group_idx (default None) is left out while None, as msgspec's omit_defaults does
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [h(1)], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_llmd_wire_is_positional_arrays_with_uint64_hashes() -> None:
    wire_hash = [external_hash(x, WIRE_LLMD) for x in (h(0), h(1), h(2))]
    assert all(isinstance(x, int) and 0 <= x < 2**64 for x in wire_hash)
    assert wire_hash[1] == int.from_bytes(h(1), "big") & (2**64 - 1)
    stored = BlockStored(
        (wire_hash[1], wire_hash[2]), wire_hash[0], (5, 6, 7, 8), 2, None, MEDIUM_CPU, None
    )
    batch = EventBatch(1.0, (stored, BlockRemoved((wire_hash[1],), MEDIUM_CPU)), 0)
    ts, events, rank = msgpack.unpackb(encode_batch(batch, WIRE_LLMD), raw=False)
    # llm-d's decoder: [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name]
    tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name = events[0]
    assert (tag, hashes, parent) == ("BlockStored", wire_hash[1:], wire_hash[0])
    assert (tokens, block_size, lora_id, medium, lora_name) == ([5, 6, 7, 8], 2, None, "CPU", None)
    assert events[1] == ["BlockRemoved", [wire_hash[1]], "CPU"]
    assert (ts, rank) == (1.0, 0)


@pytest.mark.parametrize("wire", [WIRE_VLLM, WIRE_LLMD])
def test_both_wires_decode_back_to_the_same_events(wire: str) -> None:
    assert decode_batch(encode_batch(sample_batch(), wire)) == sample_batch()


def test_fields_a_newer_vllm_adds_are_ignored_in_both_shapes() -> None:
    as_map = {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "locality": "LOCAL"}
    as_array = ["BlockRemoved", [7], "CPU", None, "LOCAL", "tier-2"]
    for event in (as_map, as_array):
        assert decode_batch(msgpack.packb([1.0, [event], 0])).events == (
            BlockRemoved((7,), MEDIUM_CPU),
        )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, [{"type": "Bogus"}], 0]),
        msgpack.packb([1.0, [["BlockStored", [1], None]], 0]),  # fields missing
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]]),
        msgpack.packb([1.0, [["BlockRemoved", [1], 7]], 0]),  # medium is not a string
        msgpack.packb([1.0, [["BlockStored", [1], None, ["5"], 16, None, "GPU", None]], 0]),
    ],
)
def test_malformed_batches_raise_a_typed_error(payload: bytes) -> None:
    with pytest.raises(KVEventsError):
        decode_batch(payload)


def test_config_takes_vllm_kv_events_config_keys_and_rejects_bad_ones() -> None:
    config = KVEventsConfig.from_dict(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    )
    assert (config.endpoint, config.replay_endpoint, config.buffer_steps) == (
        "tcp://*:5557",
        None,
        10_000,
    )
    with pytest.raises(ConfigError, match="unknown kv events knob"):
        KVEventsConfig.from_dict({"endpont": "tcp://*:1"})
    with pytest.raises(ConfigError, match="wire"):
        KVEventsConfig(wire="json")
    with pytest.raises(ConfigError, match="scheme"):
        KVEventsConfig(endpoint="localhost:5557")
    assert llmd_topic("pod-a", "tiny") == "kv@pod-a@tiny"
    with pytest.raises(ConfigError, match="without '@'"):
        llmd_topic("a@b", "tiny")


# ----------------------------------------------------------- publisher, replay


def test_subscriber_receives_topic_sequence_and_batch_frames(tmp_path: Path) -> None:
    pub_ep, replay_ep = endpoints(tmp_path)
    config = KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv@p@m")
    with ZmqEventPublisher(config) as pub:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sock.connect(pub.endpoint)
        try:
            frames: list[bytes] = []
            deadline = time.monotonic() + 10
            while not frames:  # PUB drops what it sends before the subscription lands
                assert time.monotonic() < deadline
                pub.publish([AllBlocksCleared()])
                if sock.poll(100):
                    frames = sock.recv_multipart()
            topic, seq, payload = frames
            assert topic == b"kv@p@m" and len(seq) == 8
            assert decode_batch(payload).events == (AllBlocksCleared(),)
        finally:
            sock.close(linger=0)
            ctx.term()


def test_replay_endpoint_returns_batches_published_before_the_subscriber_came(
    tmp_path: Path,
) -> None:
    pub_ep, replay_ep = endpoints(tmp_path)
    with ZmqEventPublisher(KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as pub:
        for i in range(3):  # no subscriber yet: PUB drops these, the replay buffer keeps them
            pub.publish([BlockStored((h(i),), None, (), 16, None, MEDIUM_GPU, None)])
            pub.flush()
        assert pub.published == 3
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            replayed = sub.replay(0)
            assert [r.seq for r in replayed] == [0, 1, 2]
            assert [r.batch.events[0].block_hashes for r in replayed] == [  # type: ignore[union-attr]
                (h(0),),
                (h(1),),
                (h(2),),
            ]
            assert [r.seq for r in sub.replay(2)] == [2]
            assert sub.replay(3) == []


def test_a_late_subscriber_catches_up_from_the_replay_buffer_then_goes_live(tmp_path: Path) -> None:
    pub_ep, replay_ep = endpoints(tmp_path)
    with ZmqEventPublisher(KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as pub:
        for i in range(4):
            pub.publish([BlockRemoved((h(i),), MEDIUM_GPU)])
            pub.flush()
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, from_seq=0) as sub:
            got: list[int] = []
            deadline = time.monotonic() + 10
            while len(got) < 6:
                assert time.monotonic() < deadline, got
                pub.publish([BlockRemoved((h(99),), MEDIUM_GPU)])
                got.extend(r.seq for r in sub.receive(timeout_s=0.1))
            assert got == list(range(len(got)))  # 0..3 by replay, then live, no hole
            assert sub.missed == 0


def test_messages_the_pub_socket_dropped_come_back_by_replay_in_order(tmp_path: Path) -> None:
    pub_ep, replay_ep = endpoints(tmp_path)
    config = KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep, hwm=1)
    big = [BlockRemoved(tuple(h(i) for i in range(1000)), MEDIUM_GPU)] * 64  # ~2 MB a batch
    with (
        ZmqEventPublisher(config) as pub,
        EventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, from_seq=0, hwm=1
        ) as sub,
    ):
        assert list(sub.receive(timeout_s=0.5)) == []  # caught up: nothing published yet
        for _ in range(40):  # ~80 MB while nobody reads: the PUB socket drops most
            pub.publish(big)
            pub.flush()
        got: list[ReceivedBatch] = []
        deadline = time.monotonic() + 30
        while not got or got[-1].seq < 40:
            assert time.monotonic() < deadline, [r.seq for r in got]
            pub.publish([AllBlocksCleared()])
            got.extend(sub.receive(timeout_s=0.1))
        assert [r.seq for r in got] == list(range(len(got)))
        assert any(r.replayed for r in got), "nothing was dropped: the test proves nothing"
        assert sub.missed == 0


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    config = KVEventsConfig(endpoint=f"ipc://{tmp_path}/q", max_queue_size=1)
    with ZmqEventPublisher(config) as pub:
        t0 = time.monotonic()
        pub.publish([AllBlocksCleared()] * 10_000)
        assert time.monotonic() - t0 < 5  # generous: it must not wait for the thread
        assert pub.dropped > 0


def test_a_port_in_use_is_a_config_error() -> None:
    with ZmqEventPublisher(KVEventsConfig(endpoint="tcp://*:0")) as first:
        port = first.endpoint.rpartition(":")[2]
        with pytest.raises(ConfigError, match="cannot open KV events socket"):
            ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://*:{port}"))


# ---------------------------------------------------------------- the pools


def test_host_pool_publishes_every_store_and_eviction_its_counters_show(tmp_path: Path) -> None:
    from kvbridge.worker.offload.pool import HostPool, pool_key

    pub_ep, replay_ep = endpoints(tmp_path)
    with ZmqEventPublisher(KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as pub:
        source = KVEventSource(
            pub, medium=MEDIUM_CPU, block_size=16, wire=WIRE_VLLM, key_prefix=len(pool_key(0, b""))
        )
        pool = HostPool(4, 64, events=source)
        stored: list[bytes] = []
        for round_ in range(5):  # 5 x 3 blocks into 4 slots: evictions from round 2 on
            hashes = [h(10 * round_ + i) for i in range(3)]
            prep = pool.prepare_store([pool_key(0, x) for x in hashes], ttl_s=30, writer="w")
            assert pool.mark_written(prep.store_id, "w")
            pool.commit_store(prep.store_id, "w", 7, [bytes(16)] * len(prep.slots))
            stored += [hashes[i] for i in prep.indices]
        stats = pool.stats()
        assert stats.evicted_blocks > 0
        pub.flush()
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            batches = [r.batch for r in sub.replay(0)]
    events = [e for b in batches for e in b.events]
    put = [x for e in events if isinstance(e, BlockStored) for x in e.block_hashes]
    gone = [x for e in events if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert len(put) == stats.stored_blocks and put == stored  # the hash, without the rank
    assert len(gone) == stats.evicted_blocks
    assert {e.medium for e in events if not isinstance(e, AllBlocksCleared)} == {"CPU"}
    index = PrefixIndex()
    for batch in batches:
        index.apply("daemon", batch)
    assert len(index.holds("daemon", MEDIUM_CPU)) == stats.cached_blocks == 4


def test_engine_prefix_cache_events_match_what_its_pool_holds(tmp_path: Path) -> None:
    from kvbridge.worker.engine import Engine, EngineConfig

    pub_ep, replay_ep = endpoints(tmp_path)
    config = EngineConfig.preset("tiny", block_size=16, num_blocks=12)
    with ZmqEventPublisher(KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as pub:
        source = KVEventSource(pub, medium=MEDIUM_GPU, block_size=16, wire=WIRE_VLLM, group_idx=0)
        engine = Engine(config, events=source)
        for seed in range(4):  # 4 prompts of 4 full blocks in a 12-block pool: evictions
            prompt = [(seed * 37 + i) % 200 + 1 for i in range(64)]
            engine.add_request(prompt, 2)
            while engine.has_unfinished():
                engine.step()
        pool = engine.pools["self"]
        pub.flush()
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
            batches = [r.batch for r in sub.replay(0)]
    events = [e for b in batches for e in b.events]
    put = [x for e in events if isinstance(e, BlockStored) for x in e.block_hashes]
    gone = [x for e in events if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert gone, "the workload must evict"
    assert len(put) - len(gone) == pool.num_cached_blocks
    index = PrefixIndex()
    for batch in batches:
        index.apply("node", batch)
    held = index.holds("node", MEDIUM_GPU)
    assert len(held) == pool.num_cached_blocks
    assert all(pool.get_block(x) is not None for x in held)  # type: ignore[arg-type]
    assert all(e.group_idx == 0 for e in events if isinstance(e, (BlockStored, BlockRemoved)))


# ------------------------------------------------------------------ the edges


def test_kvbridge_loads_no_zmq_unless_events_are_configured() -> None:
    code = (
        "import sys\n"
        "import kvbridge.connector.events, kvbridge.worker.offload.pool\n"
        "import kvbridge.worker.engine, kvbridge.worker.serving.router\n"
        "from kvbridge.worker.cli import build_parser; build_parser()\n"
        "print('zmq' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_without_pyzmq_a_publisher_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    with pytest.raises(ConfigError, match=r"kvbridge\[events\]"):
        ZmqEventPublisher(KVEventsConfig(endpoint=f"ipc://{tmp_path}/x"))


@pytest.mark.parametrize("argv", [["serve"], ["offload", "serve"]])
def test_serve_commands_take_the_kv_events_flags(argv: list[str]) -> None:
    from kvbridge.worker.cli import build_parser

    parser = build_parser()
    help_text = subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.cli", *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for flag in ("--kv-events ENDPOINT", "--kv-events-replay", "--kv-events-topic", "llm-d"):
        assert flag in help_text, flag
    args = parser.parse_args(
        [*argv, "--kv-events", "tcp://*:5557", "--kv-events-topic", "kv@pod@tiny",
         "--kv-events-wire", "llm-d"]
    )  # fmt: skip
    from kvbridge.worker.kv_events import kv_events_from_args

    assert kv_events_from_args(args) == KVEventsConfig(
        endpoint="tcp://*:5557", topic="kv@pod@tiny", wire=WIRE_LLMD
    )
    assert kv_events_from_args(parser.parse_args(argv)) is None


# ---------------------------------------------------- the vLLM connector's relay


def test_offload_relay_passes_the_daemons_events_and_turns_a_restart_into_removals(
    tmp_path: Path,
) -> None:
    from kvbridge.connector.vllm.events import OffloadEventRelay

    pub_ep, replay_ep = endpoints(tmp_path)
    with ZmqEventPublisher(KVEventsConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as pub:
        source = KVEventSource(pub, medium=MEDIUM_CPU, block_size=16, wire=WIRE_VLLM)
        source.cleared()  # the daemon starts: nothing relayed yet, nothing to remove
        source.stored([h(1)])
        source.stored([h(2)])
        source.removed([h(1)])
        source.cleared()  # the daemon restarted: h(2) is gone with it
        pub.flush()
        relay = OffloadEventRelay(pub.endpoint, pub.replay_endpoint)
        try:
            events = relay.take()
        finally:
            relay.close()
    assert [type(e).__name__ for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
    ]
    assert events[-1] == BlockRemoved((h(2),), MEDIUM_CPU)  # never AllBlocksCleared: that
    # would tell consumers the vLLM pod's own GPU cache was cleared


def test_vllm_extra_config_takes_the_daemons_event_endpoints() -> None:
    from kvbridge.connector.vllm.config import VllmConnectorConfig

    def config(**extra: object) -> VllmConnectorConfig:
        return VllmConnectorConfig.from_vllm("kv_consumer", "e", extra, "m")

    assert config().offload_events is None
    assert config(offload_kv_events="tcp://127.0.0.1:5567").offload_events == (
        "tcp://127.0.0.1:5567",
        None,
    )
    both = config(offload_kv_events="ipc:///x", offload_kv_events_replay="ipc:///y")
    assert both.offload_events == ("ipc:///x", "ipc:///y")
    with pytest.raises(ConfigError, match="needs offload_kv_events"):
        config(offload_kv_events_replay="ipc:///y")
    with pytest.raises(ConfigError, match="scheme"):
        config(offload_kv_events="127.0.0.1:5567")

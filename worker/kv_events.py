"""KV events for kvbridge's own processes: the ``--kv-events`` flags and the publisher
each process opens from them.

``kvbridge serve`` publishes its reference engine's prefix cache with medium ``GPU``
(the medium vLLM's CPU build reports for its own KV cache, which also lives in host
memory); ``kvbridge offload serve`` publishes its host pool with medium ``CPU``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvbridge.connector.events import (
    WIRE_LLMD,
    WIRE_VLLM,
    BlockEventSink,
    KVEventsConfig,
    KVEventSource,
    ZmqEventPublisher,
)
from kvbridge.worker.cli_checks import positive_int

__all__ = ["add_kv_events_arguments", "kv_events_from_args", "open_sink"]


def add_kv_events_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--kv-events ENDPOINT`` and its companions, for a process that publishes ``what``."""
    g = p.add_argument_group("KV events (vLLM's kv_events_config; needs pyzmq)")
    g.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help=f"publish {what} stored/removed/cleared as vLLM KV events on this ZMQ PUB "
        "endpoint: tcp://*:PORT binds, tcp://HOST:PORT connects (default: no events)",
    )
    g.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="ZMQ ROUTER endpoint (bound) that replays missed batches, e.g. tcp://*:5558",
    )
    g.add_argument(
        "--kv-events-topic",
        default="",
        metavar="TOPIC",
        help="topic frame of every message (default empty); llm-d expects kv@<pod>@<model>",
    )
    g.add_argument(
        "--kv-events-wire",
        choices=[WIRE_VLLM, WIRE_LLMD],
        default=WIRE_VLLM,
        help="vllm: vLLM 0.32's bytes exactly (events as tagged maps, byte hashes); "
        "llm-d: events as positional arrays with 64-bit integer hashes (default vllm)",
    )
    g.add_argument(
        "--kv-events-buffer",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="batches kept for replay (vLLM's buffer_steps, default 10000)",
    )


def kv_events_from_args(args: argparse.Namespace) -> KVEventsConfig | None:
    """The config the flags ask for; None without ``--kv-events``."""
    if args.kv_events is None:
        return None
    return KVEventsConfig(
        endpoint=args.kv_events,
        replay_endpoint=args.kv_events_replay,
        topic=args.kv_events_topic,
        wire=args.kv_events_wire,
        buffer_steps=args.kv_events_buffer,
    )


def open_sink(
    config: KVEventsConfig, medium: str, *, group_idx: int | None = None, key_prefix: int = 0
) -> tuple[ZmqEventPublisher, Callable[[int], BlockEventSink]]:
    """A started publisher, and a maker of sinks on it for a cache of a given block size
    (tokens). Each sink announces ``AllBlocksCleared`` when made: its cache starts empty,
    so a subscriber drops what an earlier run of the process announced. ``key_prefix``:
    bytes cut off each cache key before its hash (the daemon's 2-byte TP rank)."""
    publisher = ZmqEventPublisher(config)

    def make(block_size: int) -> BlockEventSink:
        sink = KVEventSource(
            publisher,
            medium=medium,
            block_size=block_size,
            wire=config.wire,
            key_prefix=key_prefix,
            group_idx=group_idx,
        )
        sink.cleared()
        return sink

    return publisher, make

"""KV cache events in vLLM's wire format: who holds which block, for KV-aware routers.

``wire`` (the msgpack shapes, both vLLM's and llm-d's), ``config`` (vLLM's
``kv_events_config`` knobs), ``publisher`` (ZMQ PUB + replay ROUTER, pyzmq loaded lazily),
``source`` (the sink a block cache calls), ``subscriber`` and ``index`` (the reading side).
"""

from kvbridge.connector.events.config import KVEventsConfig, llmd_topic
from kvbridge.connector.events.index import PrefixIndex
from kvbridge.connector.events.publisher import END_SEQ, ZmqEventPublisher
from kvbridge.connector.events.source import BlockEventSink, KVEventSource
from kvbridge.connector.events.subscriber import EventSubscriber, ReceivedBatch
from kvbridge.connector.events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    WIRE_LLMD,
    WIRE_VLLM,
    WIRES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalHash,
    KVEvent,
    KVEventsError,
    decode_batch,
    encode_batch,
    external_hash,
)

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "WIRES",
    "WIRE_LLMD",
    "WIRE_VLLM",
    "AllBlocksCleared",
    "BlockEventSink",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventSubscriber",
    "ExternalHash",
    "KVEvent",
    "KVEventSource",
    "KVEventsConfig",
    "KVEventsError",
    "PrefixIndex",
    "ReceivedBatch",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "external_hash",
    "llmd_topic",
]

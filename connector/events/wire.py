"""vLLM's KV-events wire format: the msgpack shapes of ``KVEventBatch`` and its events.

vLLM 0.32 (``vllm/distributed/kv_events.py``) encodes with msgspec:

- a batch is a positional array ``[ts, events, data_parallel_rank]`` (the struct is
  ``array_like``; the rank is always set by its publisher);
- each event is a tagged struct encoded as a **map** whose first key is ``"type"``
  (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``), then its fields in
  declaration order; fields whose default is ``None`` are left out while they are ``None``
  (``omit_defaults``), required ones are always written (``None`` as nil);
- block hashes are the raw hash bytes (msgpack *bin*), or, with vLLM's
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the low 64 bits of the big-endian integer.

llm-d's KV-cache manager (and older vLLM) reads every event as a positional array
``[tag, field, field, ...]`` with ``uint64`` hashes. :data:`WIRE_VLLM` writes the first
shape byte for byte, :data:`WIRE_LLMD` the second; :func:`decode_batch` reads both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvbridge.proto.errors import KVBridgeError

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "WIRES",
    "WIRE_LLMD",
    "WIRE_VLLM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalHash",
    "KVEvent",
    "KVEventsError",
    "decode_batch",
    "encode_batch",
    "external_hash",
]

MEDIUM_GPU = "GPU"
"""vLLM's device cache; its CPU build reports this medium for its (host-memory) KV cache too."""
MEDIUM_CPU = "CPU"
"""A host-memory offload tier (kvbridge's offload daemon)."""
MEDIUM_STORAGE = "STORAGE"
"""vLLM's name for a file-system tier (there is no ``"DISK"`` medium in vLLM)."""

WIRE_VLLM = "vllm"
WIRE_LLMD = "llm-d"
WIRES = (WIRE_VLLM, WIRE_LLMD)

MAX_BATCH_BYTES = 64 << 20
"""Largest payload :func:`decode_batch` accepts."""

ExternalHash = bytes | int
"""A block hash as it travels: raw bytes (``vllm``) or a 64-bit integer (``llm-d``)."""


class KVEventsError(KVBridgeError, ValueError):
    """A KV event could not be published or decoded; the message says why."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered a cache: ``block_hashes`` chain on from ``parent_block_hash``."""

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left a cache (evicted or dropped)."""

    block_hashes: tuple[ExternalHash, ...]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Everything the publisher announced before is gone (it started or was reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: events in the order they happened."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes, wire: str) -> ExternalHash:
    """``block_hash`` as ``wire`` sends it (``llm-d``: low 64 bits, big-endian, like vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    if wire == WIRE_LLMD:
        return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
    return bytes(block_hash)


# (name, default-is-None-and-omittable) in vLLM 0.32's declaration order
_STORED_FIELDS = (
    ("block_hashes", False),
    ("parent_block_hash", False),
    ("token_ids", False),
    ("block_size", False),
    ("lora_id", False),
    ("medium", False),
    ("lora_name", False),
    ("extra_keys", True),
    ("group_idx", True),
)
_REMOVED_FIELDS = (("block_hashes", False), ("medium", False), ("group_idx", True))


def _field_values(event: KVEvent) -> tuple[str, tuple[tuple[str, bool], ...], list[Any]]:
    """(tag, field spec, values in declaration order) of ``event``."""
    if isinstance(event, BlockStored):
        values = [
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            None,  # extra_keys: kvbridge's hashes are not vLLM's, so it sends none
            event.group_idx,
        ]
        return "BlockStored", _STORED_FIELDS, values
    if isinstance(event, BlockRemoved):
        values = [list(event.block_hashes), event.medium, event.group_idx]
        return "BlockRemoved", _REMOVED_FIELDS, values
    return "AllBlocksCleared", (), []


def _to_wire(event: KVEvent, wire: str) -> Any:
    """msgspec's ``omit_defaults``: a map drops every field still at its ``None`` default;
    an array drops only the trailing run of them (positions must not shift)."""
    tag, spec, values = _field_values(event)
    if wire == WIRE_LLMD:
        while values and spec[len(values) - 1][1] and values[-1] is None:
            values.pop()
        return [tag, *values]
    out: dict[str, Any] = {"type": tag}
    for (name, omittable), value in zip(spec, values, strict=True):
        if not (omittable and value is None):
            out[name] = value
    return out


def encode_batch(batch: EventBatch, wire: str = WIRE_VLLM) -> bytes:
    """The msgpack bytes of ``batch`` in ``wire``'s shape (hashes must already be in the
    wire's form, see :func:`external_hash`)."""
    if wire not in WIRES:
        raise KVEventsError(f"unknown KV events wire {wire!r}: use one of {', '.join(WIRES)}")
    body: list[Any] = [float(batch.ts), [_to_wire(e, wire) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from either wire shape; :class:`KVEventsError` for anything else."""
    if len(payload) > MAX_BATCH_BYTES:
        raise KVEventsError(f"KV event batch of {len(payload)} bytes is over {MAX_BATCH_BYTES}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVEventsError(f"KV event batch is not msgpack: {exc}") from None
    if not isinstance(body, list) or not 2 <= len(body) <= 3:
        raise KVEventsError("a KV event batch is an array [ts, events, data_parallel_rank?]")
    ts, raw_events = body[0], body[1]
    rank = body[2] if len(body) == 3 else None
    if not isinstance(ts, (int, float)) or not isinstance(raw_events, list):
        raise KVEventsError("a KV event batch needs a number ts and an events array")
    if rank is not None and not isinstance(rank, int):
        raise KVEventsError(f"data_parallel_rank must be an int, got {rank!r}")
    return EventBatch(float(ts), tuple(_decode_event(e) for e in raw_events), rank)


def _decode_event(raw: Any) -> KVEvent:
    """One event of either shape; fields a newer vLLM adds (map keys, trailing array
    positions) are ignored, as llm-d's decoder does."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        values = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        values = {name: v for (name, _), v in zip(names, raw[1:], strict=False)}
    else:
        raise KVEventsError("a KV event is a tagged map or a tagged array")
    try:
        if tag == "BlockStored":
            return BlockStored(
                _hashes(values["block_hashes"]),
                _one_hash(values["parent_block_hash"]),
                tuple(_typed(t, int, "token id") for t in values["token_ids"]),
                _typed(values["block_size"], int, "block_size"),
                _typed(values.get("lora_id"), int | None, "lora_id"),
                _typed(values.get("medium"), str | None, "medium"),
                _typed(values.get("lora_name"), str | None, "lora_name"),
                _typed(values.get("group_idx"), int | None, "group_idx"),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(
                _hashes(values["block_hashes"]),
                _typed(values.get("medium"), str | None, "medium"),
                _typed(values.get("group_idx"), int | None, "group_idx"),
            )
    except (KeyError, TypeError) as exc:
        raise KVEventsError(f"malformed {tag} event: {exc!r}") from None
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventsError(f"unknown KV event type {tag!r}")


def _typed(value: Any, kind: Any, name: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} has type {type(value).__name__}")
    return value


def _one_hash(value: Any) -> ExternalHash | None:
    if value is None or isinstance(value, (bytes, int)):
        return value  # type: ignore[no-any-return]
    raise TypeError(f"a block hash is bytes or an int, got {type(value).__name__}")


def _hashes(values: Sequence[Any]) -> tuple[ExternalHash, ...]:
    if not isinstance(values, list):
        raise TypeError("block_hashes is not an array")
    out = tuple(_one_hash(v) for v in values)
    if any(h is None for h in out):
        raise TypeError("block_hashes holds a nil")
    return out  # type: ignore[return-value]

"""``KVEventsConfig``: where and how a kvbridge process publishes KV events.

The knobs are vLLM's ``kv_events_config`` ones (``endpoint``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``) with vLLM's defaults, plus
``wire`` (:data:`~kvbridge.connector.events.wire.WIRES`) for the consumer's decoder.
An endpoint is bound when it holds a wildcard (``*``, ``::``) or is ``ipc://`` /
``inproc://``, and connected to otherwise, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvbridge.connector.events.wire import WIRE_LLMD, WIRE_VLLM, WIRES
from kvbridge.proto.errors import ConfigError

__all__ = ["KVEventsConfig", "llmd_topic"]

_SCHEMES = ("tcp://", "ipc://", "inproc://")


def llmd_topic(pod: str, model: str) -> str:
    """The topic llm-d's KV-cache manager subscribes to: ``kv@<pod>@<model>``."""
    for name, value in (("pod", pod), ("model", model)):
        if not value or "@" in value:
            raise ConfigError(f"llm-d topic {name} must be non-empty without '@', got {value!r}")
    return f"kv@{pod}@{model}"


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """One publisher's settings, built once at the edge (CLI flags or extra config)."""

    endpoint: str = "tcp://*:5557"
    """PUB socket: ``tcp://*:PORT`` binds every interface, ``tcp://HOST:PORT`` connects."""
    replay_endpoint: str | None = None
    """ROUTER socket answering replay requests (8-byte big-endian start sequence); bound."""
    topic: str = ""
    """First frame of every message; llm-d expects ``kv@<pod>@<model>`` (:func:`llmd_topic`)."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """ZMQ high-water mark of the PUB socket."""
    max_queue_size: int = 100_000
    """Events waiting for the publisher thread; past it new events are dropped and counted."""
    wire: str = WIRE_VLLM
    """``vllm``: byte-identical to vLLM 0.32 (tagged maps, bytes hashes); ``llm-d``:
    positional arrays with 64-bit integer hashes."""
    data_parallel_rank: int = 0
    """Written into every batch, as vLLM's publisher does."""

    def __post_init__(self) -> None:
        for knob in ("endpoint", "replay_endpoint"):
            value = getattr(self, knob)
            if value is not None and not value.startswith(_SCHEMES):
                raise ConfigError(
                    f"kv events {knob} {value!r} needs a tcp://, ipc:// or inproc:// scheme"
                )
        for knob in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"kv events {knob} must be >= 1, got {getattr(self, knob)}")
        if self.wire not in WIRES:
            raise ConfigError(
                f"kv events wire must be {WIRE_VLLM!r} or {WIRE_LLMD!r}, got {self.wire!r}"
            )
        if self.data_parallel_rank < 0:
            raise ConfigError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVEventsConfig:
        """From a vLLM-style ``kv_events_config`` mapping; unknown keys are a ConfigError.

        vLLM's own ``enable_kv_cache_events`` and ``publisher`` keys are accepted and
        checked (a mapping that disables events is an error here: pass none instead).
        """
        raw = dict(raw)
        if raw.pop("enable_kv_cache_events", True) is not True:
            raise ConfigError("kv events config has enable_kv_cache_events off: leave it out")
        if raw.pop("publisher", "zmq") != "zmq":
            raise ConfigError("kv events publisher must be 'zmq' (the only one kvbridge has)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv events knob(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**raw)

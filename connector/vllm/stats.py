"""kvbridge's per-load figures in vLLM's own stats: the periodic log line and Prometheus.

No vLLM import: :class:`TransferStats` records the worker half's
:class:`~kvbridge.connector.base.LoadResult` s and the functions here merge and
summarise the plain ``dict`` that vLLM carries from the worker to its logger
(``KVConnectorStats.data``); the thin vLLM classes that wrap them are in
:mod:`kvbridge.connector.vllm.connector`.

vLLM collects the worker's stats every step and the logger resets its
accumulator at every log interval, so the data only ever holds one step's or
one interval's loads; on top of that each sample list is capped at
:data:`MAX_SAMPLES` (counts stay exact, the percentiles and histograms then
see the first :data:`MAX_SAMPLES` of the interval). Names follow vLLM's
NixlConnector where they mean the same (``transfer_duration`` in seconds,
``bytes_transferred``, ``num_descriptors``, ``num_failed_transfers``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvbridge.connector.base import LoadResult

__all__ = [
    "COUNTERS",
    "MAX_SAMPLES",
    "PROM_COUNTERS",
    "PROM_HISTOGRAMS",
    "SAMPLES",
    "TransferStats",
    "empty",
    "is_empty",
    "merge",
    "reduce",
]

MAX_SAMPLES = 4096
"""Per-load samples one stats dict keeps per list (one step's or one log interval's)."""

SAMPLES = ("transfer_duration", "bytes_transferred", "num_descriptors", "num_blocks")
"""One entry per successful load from a peer: seconds the load took (the offload daemon's
part included), bytes and descriptors READ from the peer, blocks moved from the peer."""
COUNTERS = ("num_transfers", "num_failed_transfers", "num_failed_blocks", "num_offloaded_blocks")
"""Exact counts: successful loads, failed loads (the request recomputes), blocks reported
bad to vLLM, blocks loaded from the CPU offload daemon."""

PROM_HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    (
        "vllm:kvbridge_xfer_time_seconds",
        "transfer_duration",
        "Seconds one request's kvbridge KV load took.",
        (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0),
    ),
    (
        "vllm:kvbridge_bytes_transferred",
        "bytes_transferred",
        "Bytes one request's kvbridge KV load read from its peer.",
        tuple(float(2 ** (10 + i)) for i in range(1, 25, 2)),
    ),
    (
        "vllm:kvbridge_num_descriptors",
        "num_descriptors",
        "Transfer descriptors of one request's kvbridge KV load.",
        (1, 2, 5, 10, 20, 50, 100, 200, 400, 1000, 4000, 10000),
    ),
    (
        "vllm:kvbridge_num_blocks",
        "num_blocks",
        "KV blocks one request's kvbridge load moved from its peer.",
        (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    ),
)
"""(Prometheus name, data key, help, buckets) of each histogram."""

PROM_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "vllm:kvbridge_num_failed_transfers",
        "num_failed_transfers",
        "kvbridge KV loads that failed (their blocks are recomputed).",
    ),
    (
        "vllm:kvbridge_num_failed_blocks",
        "num_failed_blocks",
        "KV blocks kvbridge reported to vLLM as not loaded.",
    ),
    (
        "vllm:kvbridge_num_offloaded_blocks",
        "num_offloaded_blocks",
        "KV blocks loaded from kvbridge's CPU offload daemon.",
    ),
)
"""(Prometheus name, data key, help) of each counter."""


def empty() -> dict[str, Any]:
    """A stats dict with nothing recorded (msgpack/pickle-able: lists and ints)."""
    data: dict[str, Any] = {k: [] for k in SAMPLES}
    data.update(dict.fromkeys(COUNTERS, 0))
    return data


def is_empty(data: Mapping[str, Any]) -> bool:
    return not any(data.get(k) for k in COUNTERS)


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``other``'s loads to ``into`` (in place; returns it)."""
    for k in SAMPLES:
        room = MAX_SAMPLES - len(into[k])
        if room > 0:
            into[k].extend(list(other.get(k, ()))[:room])
    for k in COUNTERS:
        into[k] += int(other.get(k, 0))
    return into


def reduce(data: Mapping[str, Any]) -> dict[str, int | float]:
    """The summary vLLM prints as ``KV Transfer metrics: ...`` (NixlConnector's names where
    they mean the same)."""
    durations = sorted(float(x) for x in data["transfer_duration"])
    n = len(durations)
    seconds = sum(durations)
    mb = sum(data["bytes_transferred"]) / 2**20
    out: dict[str, int | float] = {
        "Num successful transfers": int(data["num_transfers"]),
        "Avg xfer time (ms)": round(seconds / n * 1e3, 3) if n else 0,
        "P90 xfer time (ms)": round(durations[min(n - 1, int(0.9 * n))] * 1e3, 3) if n else 0,
        "Avg MB per transfer": round(mb / n, 3) if n else 0,
        "Throughput (MB/s)": round(mb / seconds, 3) if seconds > 0 else 0,
        "Avg number of descriptors": round(sum(data["num_descriptors"]) / n, 1) if n else 0,
        "Avg blocks per transfer": round(sum(data["num_blocks"]) / n, 1) if n else 0,
        "Num failed transfers": int(data["num_failed_transfers"]),
        "Num failed blocks": int(data["num_failed_blocks"]),
        "Num offloaded blocks": int(data["num_offloaded_blocks"]),
    }
    return out


class TransferStats:
    """The worker half's loads since vLLM last collected them; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()

    def record(self, result: LoadResult) -> None:
        """Count one finished load (failed or not)."""
        one = empty()
        if result.error:
            one["num_failed_transfers"] = 1
        elif result.blocks_moved or result.blocks_offloaded:
            one["num_transfers"] = 1
            one["transfer_duration"] = [result.transfer_ms / 1e3]
            one["bytes_transferred"] = [result.bytes_moved]
            one["num_descriptors"] = [result.descriptors]
            one["num_blocks"] = [result.blocks_moved]
        one["num_failed_blocks"] = len(result.bad_block_ids)
        one["num_offloaded_blocks"] = result.blocks_offloaded
        with self._lock:
            merge(self._data, one)

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        with self._lock:
            if is_empty(self._data):
                return None
            data, self._data = self._data, empty()
        return data

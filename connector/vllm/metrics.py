"""kvbridge's loads in vLLM's stats and on its Prometheus endpoint (imports vLLM).

vLLM asks the connector class for these (``build_kv_connector_stats``,
``build_prom_metrics``); the rules (what is kept, merged and reduced) are in
:mod:`kvbridge.connector.vllm.stats`, which imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvbridge.connector.vllm import stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVBridgePromMetrics", "KVBridgeStats"]


@dataclass
class KVBridgeStats(KVConnectorStats):
    """kvbridge's loads in vLLM's stats (worker → scheduler → logger); the rules are in
    :mod:`kvbridge.connector.vllm.stats`."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """kvbridge's histograms and counters on vLLM's Prometheus endpoint
    (:data:`~kvbridge.connector.vllm.stats.PROM_HISTOGRAMS`, ``PROM_COUNTERS``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(
                    name=name, documentation=doc, buckets=list(buckets), labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, key, doc, buckets in stats.PROM_HISTOGRAMS
        }
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, key, doc in stats.PROM_COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for key, per_engine in self._counters.items():
            if n := transfer_stats_data.get(key, 0):
                per_engine[engine_idx].inc(n)

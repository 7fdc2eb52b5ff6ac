"""The offload daemon's Prometheus metrics (``kvbridge offload serve --metrics-port``).

Runs in the offload daemon. :class:`OffloadCollector` is a prometheus_client
custom collector: it reads one :class:`OffloadStats` snapshot per scrape, so
the pool keeps its plain counters and nothing is updated twice.
:func:`offload_registry` puts it in a registry of its own (never the global
default one); :class:`~kvbridge.worker.metrics_server.MetricsServer` serves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvbridge.worker.offload.pool import OffloadStats

__all__ = ["OffloadCollector", "offload_registry", "METRICS"]

PREFIX = "kvbridge_offload_"

GAUGES: dict[str, tuple[str, str]] = {
    # OffloadStats field -> (metric name without the prefix, help)
    "capacity_blocks": ("capacity_blocks", "Blocks the host pool holds."),
    "block_bytes": ("block_bytes", "Bytes of one block."),
    "cached_blocks": ("cached_blocks", "Committed blocks (pinned or evictable)."),
    "pinned_blocks": ("pinned_blocks", "Block pins held by loads in progress."),
    "writing_blocks": ("writing_blocks", "Slots held by stores not yet committed."),
    "quarantined_blocks": (
        "quarantined_blocks",
        "Slots of stores that expired or aborted before their WRITE completed, kept out of "
        "the free list for the grace period.",
    ),
    "disk_capacity_blocks": ("disk_capacity_blocks", "Blocks the disk tier holds (0: none)."),
    "disk_blocks": ("disk_blocks", "Blocks listed in the disk tier."),
    "disk_bytes": ("disk_bytes", "Bytes of the blocks listed in the disk tier."),
    "disk_restored_blocks": ("disk_restored_blocks", "Blocks the disk index listed at start."),
    "disk_skipped_records": (
        "disk_skipped_records",
        "Disk index records skipped at start (torn: bad checksum, or slot out of range).",
    ),
}
COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("hits_total", "Blocks found by lookups and loads."),
    "misses": ("misses_total", "Blocks asked for past the cached prefix."),
    "stored_blocks": ("stored_blocks_total", "Blocks committed by stores."),
    "stored_bytes": ("stored_bytes_total", "Bytes committed by stores."),
    "loaded_blocks": ("loaded_blocks_total", "Blocks served by completed loads."),
    "loaded_bytes": ("loaded_bytes_total", "Bytes served by completed loads."),
    "evicted_blocks": ("evicted_blocks_total", "Blocks evicted (LRU)."),
    "evicted_bytes": ("evicted_bytes_total", "Bytes evicted (LRU)."),
    "aborted_stores": ("aborted_stores_total", "Stores aborted by workers."),
    "expired": ("expired_total", "Stores and loads dropped at expiry."),
    "bad_digest_reports": (
        "bad_digest_reports_total",
        "Blocks readers reported failing their digest check after a READ.",
    ),
    "bad_digest_blocks": (
        "bad_digest_blocks_total",
        "Reported blocks the daemon's own digest check confirmed bad (dropped from the index).",
    ),
    "demoted_blocks": ("disk_demoted_blocks_total", "Host pool evictions written to disk."),
    "promoted_blocks": ("disk_promoted_blocks_total", "Disk blocks read back into the pool."),
    "disk_evicted_blocks": ("disk_evicted_blocks_total", "Blocks evicted from disk (LRU)."),
    "disk_write_bytes": ("disk_write_bytes_total", "Bytes written to the disk tier."),
    "disk_read_bytes": ("disk_read_bytes_total", "Bytes read from the disk tier."),
    "disk_bad_digest_blocks": (
        "disk_bad_digest_blocks_total",
        "Disk blocks whose bytes failed their digest at promotion (dropped, never served).",
    ),
}
SUMMARIES: dict[str, tuple[str, str, str]] = {
    # operation -> (seconds-sum field, count field, help)
    "store": ("store_seconds_sum", "store_count", "Prepare-to-commit time of stores."),
    "load": ("load_seconds_sum", "load_count", "Prepare-to-complete time of loads."),
}

METRICS: tuple[str, ...] = (
    *(PREFIX + name for name, _ in GAUGES.values()),
    PREFIX + "occupancy_ratio",
    *(PREFIX + name for name, _ in COUNTERS.values()),
    *(f"{PREFIX}{op}_latency_seconds" for op in SUMMARIES),
)
"""Every family name the collector exposes (README's Metrics table lists the same)."""


class OffloadCollector(Collector):
    """Metric families from one ``snapshot()`` per scrape (called on the HTTP thread)."""

    def __init__(self, snapshot: Callable[[], OffloadStats]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        for field_name, (name, help_text) in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, help_text, value=getattr(stats, field_name))
        capacity = stats.capacity_blocks
        yield GaugeMetricFamily(
            PREFIX + "occupancy_ratio",
            "Committed host pool blocks over capacity (0..1).",
            value=stats.cached_blocks / capacity if capacity else 0.0,
        )
        for field_name, (name, help_text) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=getattr(stats, field_name))
        for op, (sum_field, count_field, help_text) in SUMMARIES.items():
            yield SummaryMetricFamily(
                f"{PREFIX}{op}_latency_seconds",
                help_text,
                count_value=getattr(stats, count_field),
                sum_value=getattr(stats, sum_field),
            )


def offload_registry(snapshot: Callable[[], OffloadStats]) -> CollectorRegistry:
    """A registry of its own holding one :class:`OffloadCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OffloadCollector(snapshot))
    return registry

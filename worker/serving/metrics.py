"""A serving node's transfer metrics (``kvbridge serve --metrics-port``).

Runs in the serving node. :class:`NodeMetrics` owns a prometheus_client
registry of its own (never the global default one) and is fed once per
finished request by :meth:`NodeMetrics.observe` on the engine thread;
:class:`~kvbridge.worker.metrics_server.MetricsServer` serves the registry.

Failed loads are counted by a ``reason`` from a fixed set
(:data:`LOAD_FAILURE_REASONS`), never by the raw error text, so the label's
cardinality stays bounded whatever a peer says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from kvbridge.connector.base import LoadResult
    from kvbridge.worker.engine import RequestOutput

__all__ = ["NodeMetrics", "LOAD_FAILURE_REASONS", "failure_reason", "METRICS"]

TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

BLOCK_SOURCES = ("moved", "local_hit", "recomputed", "offload", "offload_bad_digest")
"""``kvbridge_blocks_total{source}``: read from the peer (every group), found in this
engine's prefix cache, recomputed after a failed load, loaded from the offload daemon,
read from the offload daemon but failing their writer's digest (never used)."""

LOAD_PATHS = ("sealed", "owner")
"""``kvbridge_loads_total{path}``: proven by the lease's seal (no control RPC), or named by
the owner over the control plane."""

# (substring of the load error, reason); the first match wins
_REASONS: tuple[tuple[str, str], ...] = (
    ("digest mismatch", "digest_mismatch"),
    ("lease expired", "lease_expired"),
    ("lease gone", "lease_expired"),
    ("lease lapsed", "lease_expired"),
    ("holds other", "mismatch"),
    ("cross blocks", "cross_blocks_gone"),
    ("deadline", "timeout"),
    ("timed out", "timeout"),
    ("failed to connect", "peer_unreachable"),
    ("connection refused", "peer_unreachable"),
    ("unavailable", "peer_unreachable"),
    ("could not", "peer_unreachable"),
    ("disconnect", "peer_unreachable"),
    ("token", "auth"),
)
LOAD_FAILURE_REASONS = (*dict.fromkeys(reason for _, reason in _REASONS), "other")

METRICS = (
    "kvbridge_transfer_seconds",
    "kvbridge_transfer_bytes_total",
    "kvbridge_blocks_total",
    "kvbridge_load_failures_total",
    "kvbridge_transfer_descriptors_total",
    "kvbridge_loads_total",
    "kvbridge_leases_held",
    "kvbridge_digest_mismatches_total",
)
"""Every family name a node exposes (README's Metrics table lists the same)."""


def failure_reason(error: str) -> str:
    """The ``reason`` label of a load error: one of :data:`LOAD_FAILURE_REASONS`."""
    text = error.lower()
    return next((reason for key, reason in _REASONS if key in text), "other")


class NodeMetrics:
    """Transfer counters of one node; ``leases_held`` is read at scrape time."""

    def __init__(self, leases_held: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.transfer_seconds = Histogram(
            "kvbridge_transfer_seconds",
            "Time to load one request's KV (peer READ and offload load together).",
            buckets=TRANSFER_BUCKETS_S,
            registry=self.registry,
        )
        self.transfer_bytes = Counter(
            "kvbridge_transfer_bytes",
            "Bytes read from peers by KV loads.",
            registry=self.registry,
        )
        self.blocks = Counter(
            "kvbridge_blocks",
            "Prompt KV blocks by where they came from: moved (read from the peer), local_hit "
            "(this engine's prefix cache), recomputed (after a failed load), offload.",
            ["source"],
            registry=self.registry,
        )
        self.load_failures = Counter(
            "kvbridge_load_failures",
            "KV loads that did not deliver every block, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.descriptors = Counter(
            "kvbridge_transfer_descriptors",
            "Transport descriptors of the peer READs of KV loads.",
            registry=self.registry,
        )
        self.loads = Counter(
            "kvbridge_loads",
            "Loads from a peer by how the blocks were proven: sealed (no control RPC) or "
            "owner (the owner named them over the control plane).",
            ["path"],
            registry=self.registry,
        )
        self.digest_mismatches = Counter(
            "kvbridge_digest_mismatches",
            "Blocks read from peers whose bytes did not match the digest their owner recorded "
            "at hand-over (each recomputed, with every later block of its prompt).",
            registry=self.registry,
        )
        self.leases_held = Gauge(
            "kvbridge_leases_held",
            "Leases this node holds on its blocks for peers that read them.",
            registry=self.registry,
        )
        self.leases_held.set_function(lambda: float(leases_held()))
        for source in BLOCK_SOURCES:  # every series exists from the first scrape, at 0
            self.blocks.labels(source)
        for reason in LOAD_FAILURE_REASONS:
            self.load_failures.labels(reason)
        for path in LOAD_PATHS:
            self.loads.labels(path)

    def observe(self, output: RequestOutput, load: LoadResult | None) -> None:
        """Count one finished request (``load`` is None when nothing was loaded for it)."""
        self.blocks.labels("local_hit").inc(output.blocks_local_hit)
        self.blocks.labels("recomputed").inc(output.blocks_recomputed)
        if load is None:
            return
        self.transfer_seconds.observe(load.transfer_ms / 1e3)
        self.transfer_bytes.inc(load.bytes_moved)
        self.blocks.labels("moved").inc(load.blocks_moved)
        self.blocks.labels("offload").inc(load.blocks_offloaded)
        self.blocks.labels("offload_bad_digest").inc(load.offload_bad_digest)
        self.descriptors.inc(load.descriptors)
        self.digest_mismatches.inc(load.digest_mismatches)
        if load.path in LOAD_PATHS:
            self.loads.labels(load.path).inc()
        if load.error:
            self.load_failures.labels(failure_reason(load.error)).inc()

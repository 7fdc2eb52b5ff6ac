"""Prometheus text exposition of the offload daemon's counters (``--metrics-port``).

Runs in the offload daemon: a stdlib ``http.server`` on its own thread
serves ``GET /metrics`` in the Prometheus text format (0.0.4), so no new
dependency is needed. Values come from a snapshot callback at scrape time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from kvbridge.worker.offload.pool import OffloadStats

__all__ = ["render_metrics", "MetricsServer"]

log = logging.getLogger(__name__)

_PREFIX = "kvbridge_offload_"
# field -> (metric name, type, help)
_METRICS: dict[str, tuple[str, str, str]] = {
    "capacity_blocks": ("capacity_blocks", "gauge", "Blocks the host pool holds."),
    "block_bytes": ("block_bytes", "gauge", "Bytes of one block."),
    "cached_blocks": ("cached_blocks", "gauge", "Committed blocks (pinned or evictable)."),
    "pinned_blocks": ("pinned_blocks", "gauge", "Block pins held by loads in progress."),
    "writing_blocks": ("writing_blocks", "gauge", "Slots held by stores not yet committed."),
    "hits": ("hits_total", "counter", "Blocks found by lookups and loads."),
    "misses": ("misses_total", "counter", "Blocks asked for past the cached prefix."),
    "stored_blocks": ("stored_blocks_total", "counter", "Blocks committed by stores."),
    "stored_bytes": ("stored_bytes_total", "counter", "Bytes committed by stores."),
    "loaded_blocks": ("loaded_blocks_total", "counter", "Blocks served by completed loads."),
    "loaded_bytes": ("loaded_bytes_total", "counter", "Bytes served by completed loads."),
    "evicted_blocks": ("evicted_blocks_total", "counter", "Blocks evicted (LRU)."),
    "evicted_bytes": ("evicted_bytes_total", "counter", "Bytes evicted (LRU)."),
    "aborted_stores": ("aborted_stores_total", "counter", "Stores aborted by workers."),
    "expired": ("expired_total", "counter", "Stores and loads dropped at expiry."),
}


def render_metrics(stats: OffloadStats) -> str:
    """The Prometheus text format of ``stats``, with occupancy and latency summaries."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.append(f"# HELP {_PREFIX}{name} {help_text}")
        lines.append(f"# TYPE {_PREFIX}{name} {kind}")
        lines.append(f"{_PREFIX}{name} {value:g}" if isinstance(value, float) else
                     f"{_PREFIX}{name} {value}")  # fmt: skip

    for field_name, (name, kind, help_text) in _METRICS.items():
        metric(name, kind, help_text, getattr(stats, field_name))
    occupancy = stats.cached_blocks / stats.capacity_blocks if stats.capacity_blocks else 0.0
    metric("occupancy_ratio", "gauge", "Committed blocks over capacity.", float(occupancy))
    for op, total, count in (
        ("store", stats.store_seconds_sum, stats.store_count),
        ("load", stats.load_seconds_sum, stats.load_count),
    ):
        name = f"{op}_latency_seconds"
        lines.append(f"# HELP {_PREFIX}{name} Prepare-to-finish time of {op}s.")
        lines.append(f"# TYPE {_PREFIX}{name} summary")
        lines.append(f"{_PREFIX}{name}_sum {total:g}")
        lines.append(f"{_PREFIX}{name}_count {count}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """``GET /metrics`` on ``host:port`` from a daemon thread; :meth:`close` stops it."""

    def __init__(self, snapshot: Callable[[], OffloadStats], host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "try /metrics")
                    return
                body = render_metrics(snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("metrics: " + format, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvbridge-offload-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

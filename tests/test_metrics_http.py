"""Prometheus metrics over real HTTP on loopback: the offload daemon's collector and the
server both the daemon and the serving node use (own registry, idle clients time out)."""

from __future__ import annotations

import dataclasses
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.proto import ConfigError
from kvbridge.worker.metrics_server import MetricsServer, MetricsServerConfig
from kvbridge.worker.offload import OffloadStats
from kvbridge.worker.offload.metrics import METRICS, offload_registry


def scrape(server: MetricsServer, timeout_s: float = 5.0) -> dict[str, float]:
    """Every sample of one scrape, by sample name (labels are not used here)."""
    with urllib.request.urlopen(server.url, timeout=timeout_s) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


class StatsSource:
    """What the daemon's handlers do: hand out a fresh snapshot per call."""

    def __init__(self) -> None:
        self.stats = OffloadStats(capacity_blocks=8, block_bytes=4096, cached_blocks=2)
        self.calls = 0

    def snapshot(self) -> OffloadStats:
        self.calls += 1
        return dataclasses.replace(self.stats)


@pytest.fixture
def source() -> StatsSource:
    return StatsSource()


@pytest.fixture
def server(source: StatsSource) -> Iterator[MetricsServer]:
    with MetricsServer(offload_registry(source.snapshot), MetricsServerConfig()) as s:
        yield s


def test_offload_metrics_are_read_from_the_pool_at_scrape_time(
    server: MetricsServer, source: StatsSource
) -> None:
    first = scrape(server)
    assert source.calls == 1
    assert first["kvbridge_offload_hits_total"] == 0
    assert first["kvbridge_offload_occupancy_ratio"] == pytest.approx(0.25)
    source.stats.hits, source.stats.stored_bytes = 5, 3 * 4096
    source.stats.store_count, source.stats.store_seconds_sum = 2, 0.5
    second = scrape(server)
    assert second["kvbridge_offload_hits_total"] == 5
    assert second["kvbridge_offload_stored_bytes_total"] == 3 * 4096
    assert second["kvbridge_offload_store_latency_seconds_count"] == 2
    assert second["kvbridge_offload_store_latency_seconds_sum"] == 0.5


def test_every_documented_offload_family_is_exposed(server: MetricsServer) -> None:
    with urllib.request.urlopen(server.url, timeout=5) as resp:
        families = {f.name for f in text_string_to_metric_families(resp.read().decode())}
    # the parser names a counter family without its _total suffix
    assert families == {name.removesuffix("_total") for name in METRICS}


def test_offload_metrics_stay_out_of_the_global_default_registry(server: MetricsServer) -> None:
    scrape(server)
    assert REGISTRY.get_sample_value("kvbridge_offload_hits_total") is None


def test_an_idle_client_neither_blocks_a_scrape_nor_holds_its_connection() -> None:
    config = MetricsServerConfig(idle_timeout_s=0.5)
    with MetricsServer(offload_registry(StatsSource().snapshot), config) as server:
        idle = socket.create_connection((server.host, server.port), timeout=10)
        try:
            t0 = time.monotonic()
            assert "kvbridge_offload_hits_total" in scrape(server, timeout_s=3)
            assert time.monotonic() - t0 < 3
            assert idle.recv(1) == b"", "the server closes a connection that sends nothing"
        finally:
            idle.close()


def test_a_scrape_gets_through_a_thousand_idle_connections() -> None:
    config = MetricsServerConfig(idle_timeout_s=30.0, max_connections=16)
    with MetricsServer(offload_registry(StatsSource().snapshot), config) as server:
        idle = []
        try:
            for _ in range(1000):
                idle.append(socket.create_connection((server.host, server.port), timeout=10))
            for _ in range(3):
                assert "kvbridge_offload_hits_total" in scrape(server, timeout_s=5)
            # the oldest idle connections were closed to make room, the newest stay open
            assert idle[0].recv(1) == b""
        finally:
            for s in idle:
                s.close()


def test_a_new_connection_past_the_limit_closes_the_oldest() -> None:
    config = MetricsServerConfig(idle_timeout_s=30.0, max_connections=2)
    with MetricsServer(offload_registry(StatsSource().snapshot), config) as server:
        address = (server.host, server.port)
        old, young = (socket.create_connection(address, timeout=10) for _ in "ab")
        try:
            assert "kvbridge_offload_hits_total" in scrape(server, timeout_s=5)
            assert old.recv(1) == b"", "the oldest connection made room"
            young.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert young.recv(12).startswith(b"HTTP/1.0 200")
        finally:
            old.close()
            young.close()


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"port": 70000}, "metrics port 70000"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"max_connections": 0}, "max_connections"),
    ],
)
def test_bad_metrics_config_names_the_knob(knobs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MetricsServerConfig(**knobs)  # type: ignore[arg-type]


def test_a_taken_port_is_a_config_error() -> None:
    with (
        MetricsServer(offload_registry(StatsSource().snapshot), MetricsServerConfig()) as first,
        pytest.raises(ConfigError, match="pick another port"),
    ):
        MetricsServer(
            offload_registry(StatsSource().snapshot), MetricsServerConfig(port=first.port)
        )


def test_readme_metrics_table_lists_exactly_the_exposed_families() -> None:
    import re
    from pathlib import Path

    from kvbridge.worker.serving.metrics import METRICS as NODE_METRICS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for cell in re.findall(r"^\| (`kvbridge_[^|]*) \|", section, flags=re.M):
        for name in re.findall(r"`([a-z_]+)(?:\{\w+\})?`", cell):
            documented.add("kvbridge_offload" + name if name.startswith("_") else name)
    assert documented == set(METRICS) | set(NODE_METRICS)

"""kvbridge inside vLLM without vLLM: its loads as vLLM stats, its log lines in vLLM's output.

:mod:`kvbridge.connector.vllm.stats` and :mod:`kvbridge.connector.vllm.logs`
import no vLLM; the thin vLLM classes around them are exercised in real vLLM by
``test_vllm_observability.py``.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvbridge.connector import LoadResult
from kvbridge.connector.vllm import stats
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.logs import follow_vllm_logging
from kvbridge.connector.vllm.worker import VllmWorker, WorkerSettings
from kvbridge.proto import BlockId, RequestId


def _ok(rid: str, ms: float, nbytes: int, blocks: int) -> LoadResult:
    return LoadResult(
        RequestId(rid), blocks, blocks, (), ms, bytes_moved=nbytes, descriptors=blocks
    )


def _failed(rid: str, bad: int) -> LoadResult:
    ids = tuple(BlockId(i) for i in range(bad))
    return LoadResult(RequestId(rid), bad, 0, ids, 5.0, "lease lapsed during the read")


class FinishingLoader:
    """Stands in for KVBridgeWorker: the loads it is given finish at the next step."""

    def __init__(self) -> None:
        self.results: dict[RequestId, LoadResult] = {}

    def get_finished(self, _: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        return set(), set(self.results)

    def pop_result(self, rid: RequestId) -> LoadResult | None:
        return self.results.pop(rid, None)


def test_a_workers_finished_loads_are_taken_once_as_vllm_collects_them() -> None:
    cfg = VllmConnectorConfig.from_vllm("kv_consumer", "d", {}, model="tiny")
    worker = VllmWorker(cfg.connector, WorkerSettings(model_name="tiny", block_size=32))
    loader = FinishingLoader()
    worker.loader = loader  # type: ignore[assignment]
    loader.results = {RequestId("a"): _ok("a", 20.0, 2**20, 3), RequestId("b"): _failed("b", 2)}
    worker.get_finished()
    data = worker.stats.take()
    assert data is not None
    assert data["num_transfers"] == 1 and data["num_failed_transfers"] == 1
    assert data["transfer_duration"] == [0.02] and data["bytes_transferred"] == [2**20]
    assert data["num_blocks"] == [3] and data["num_failed_blocks"] == 2
    assert worker.stats.take() is None  # reset when taken: nothing piles up between steps
    worker.get_finished()  # nothing new finished
    assert worker.stats.take() is None


def test_the_summary_uses_nixl_connectors_names_and_counts_failures() -> None:
    recorder = stats.TransferStats()
    for i, ms in enumerate((10.0, 20.0, 30.0, 40.0)):
        recorder.record(_ok(f"r{i}", ms, 2**20, 2))
    recorder.record(_failed("f", 3))
    offloaded = LoadResult(RequestId("o"), 4, 0, (), 4.0, blocks_offloaded=4)
    recorder.record(offloaded)
    data = recorder.take()
    assert data is not None
    summary = stats.reduce(data)
    assert summary["Num successful transfers"] == 5  # the daemon-only load counts too
    assert summary["Avg xfer time (ms)"] == pytest.approx(20.8)
    assert summary["P90 xfer time (ms)"] == pytest.approx(40.0)
    assert summary["Avg MB per transfer"] == pytest.approx(0.8)
    assert summary["Avg number of descriptors"] == pytest.approx(1.6)
    assert summary["Num failed transfers"] == 1 and summary["Num failed blocks"] == 3
    assert summary["Num offloaded blocks"] == 4
    assert stats.reduce(stats.empty())["Num successful transfers"] == 0


def test_merged_stats_keep_exact_counts_but_at_most_max_samples_each() -> None:
    many = stats.empty()
    one = stats.TransferStats()
    one.record(_ok("r", 1.0, 100, 1))
    sample = one.take()
    assert sample is not None
    for _ in range(stats.MAX_SAMPLES + 10):
        stats.merge(many, sample)
    assert many["num_transfers"] == stats.MAX_SAMPLES + 10
    assert all(len(many[k]) == stats.MAX_SAMPLES for k in stats.SAMPLES)
    assert not stats.is_empty(many) and stats.is_empty(stats.empty())


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger, io.StringIO, io.StringIO]]:
    """A stand-in for vLLM's logger with its own handler, a fresh target logger, and a root
    handler (as an application that configured logging would have)."""
    source, target = logging.getLogger("fake-vllm"), logging.getLogger("fake-kvbridge")
    out, root_out = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("VLLM %(levelname)s [%(name)s] %(message)s"))
    source.addHandler(handler)
    source.setLevel(logging.INFO)
    source.propagate = False
    root_handler = logging.StreamHandler(root_out)
    logging.getLogger().addHandler(root_handler)
    yield source, target, out, root_out
    logging.getLogger().removeHandler(root_handler)
    for log in (source, target):
        for h in list(log.handlers):
            log.removeHandler(h)
        log.setLevel(logging.NOTSET)
        log.propagate = True


def test_kvbridge_info_lines_appear_once_in_vllms_format_however_often_attached(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO, io.StringIO],
) -> None:
    _, _, out, root_out = loggers
    assert follow_vllm_logging("fake-vllm", "fake-kvbridge")
    assert not follow_vllm_logging("fake-vllm", "fake-kvbridge")  # the other half, same process
    logging.getLogger("fake-kvbridge.connector.vllm.worker").info("registered %s", "caches")
    assert out.getvalue() == "VLLM INFO [fake-kvbridge.connector.vllm.worker] registered caches\n"
    assert root_out.getvalue() == ""  # not printed a second time by the root handler


def test_an_operators_own_handler_or_vllm_without_logging_is_left_alone(
    loggers: tuple[logging.Logger, logging.Logger, io.StringIO, io.StringIO],
) -> None:
    _, target, _, _ = loggers
    own = logging.NullHandler()
    target.addHandler(own)
    assert not follow_vllm_logging("fake-vllm", "fake-kvbridge")
    assert target.handlers == [own] and target.propagate
    assert not follow_vllm_logging("no-such-vllm", "fake-kvbridge-2")
    assert logging.getLogger("fake-kvbridge-2").handlers == []

"""The worker half's offload stores: a store that fails is logged, counted and still frees.

A finished request's store is reported in ``done_sending`` exactly once whatever its outcome,
so the engine frees the blocks; a failed store (the daemon said no, or the job raised) is
logged with its reason and counted as failed, never as a successful store. The daemon is a
hand-written stand-in for :class:`~kvbridge.connector.offload.client.OffloadClient`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import pytest

from kvbridge.connector import ConnectorConfig
from kvbridge.connector.base import BlockStore, StepMetadata
from kvbridge.connector.offload import OffloadStoreResult
from kvbridge.connector.worker_side import KVBridgeWorker, StoreCounts
from kvbridge.proto import BlockHash, BlockId, RequestId


class StandInDaemon:
    """Answers ``store`` with a fixed result, or raises what it was given."""

    def __init__(self, answer: OffloadStoreResult | Exception) -> None:
        self.answer = answer

    def store(
        self, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> OffloadStoreResult:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def close(self) -> None:
        pass


@pytest.fixture
def worker() -> Iterator[KVBridgeWorker]:
    cfg = ConnectorConfig(engine_id="store-test", offload_address="127.0.0.1:9")
    w = KVBridgeWorker(cfg, None, None, None)  # type: ignore[arg-type]  # stores need neither
    yield w
    w.close()


def finish_one_store(worker: KVBridgeWorker, daemon: StandInDaemon) -> list[set[RequestId]]:
    """Run one store to its end; every ``done_sending`` seen until then and once after."""
    worker.offload = daemon  # type: ignore[assignment]
    rid = RequestId("r1")
    store = BlockStore(rid, (BlockId(1), BlockId(2)), (BlockHash(b"a" * 32), BlockHash(b"b" * 32)))
    worker.start_load_kv(StepMetadata(stores=(store,)))
    seen: list[set[RequestId]] = []
    deadline = time.monotonic() + 10
    while rid not in set().union(*seen) and time.monotonic() < deadline:
        sending, _ = worker.get_finished(set())
        seen.append(sending)
        time.sleep(0.005)
    seen.append(worker.get_finished(set())[0])
    return [s for s in seen if s]


def test_a_store_job_that_raises_is_logged_counted_failed_and_done_sending_once(
    worker: KVBridgeWorker, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.worker_side"):
        sent = finish_one_store(worker, StandInDaemon(RuntimeError("daemon exploded")))
    assert sent == [{RequestId("r1")}]
    assert worker.store_counts == StoreCounts(succeeded=0, failed=1, blocks_stored=0)
    assert any(
        "r1" in r.getMessage() and "daemon exploded" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_store_the_daemon_refused_is_logged_counted_failed_and_done_sending_once(
    worker: KVBridgeWorker, caplog: pytest.LogCaptureFixture
) -> None:
    refused = OffloadStoreResult(error="PrepareStore: UNAVAILABLE")
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector.worker_side"):
        sent = finish_one_store(worker, StandInDaemon(refused))
    assert sent == [{RequestId("r1")}]
    assert worker.store_counts == StoreCounts(succeeded=0, failed=1, blocks_stored=0)
    assert any("UNAVAILABLE" in r.getMessage() for r in caplog.records)


def test_a_good_store_counts_as_succeeded_with_its_committed_blocks(
    worker: KVBridgeWorker,
) -> None:
    sent = finish_one_store(worker, StandInDaemon(OffloadStoreResult(stored=2)))
    assert sent == [{RequestId("r1")}]
    assert worker.store_counts == StoreCounts(succeeded=1, failed=0, blocks_stored=2)

"""A failed load drops its link only when the error says the link may be broken.

Several loads can be in flight over one link to a prefill. A refusal the prefill answered
(its lease is gone, it is too busy, it rejects the request) came over a link that works:
dropping the link would close the client and disconnect the NIXL link under every other
load in flight on it, failing them all for nothing. A transfer failure, a deadline, a
malformed answer or a bug still drops the link, so the next load handshakes again.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from kvbridge.connector import BlockLoad, ConnectorConfig
from kvbridge.connector.load import Attempt, RemoteLoader
from kvbridge.proto import (
    BlockId,
    ControlPlaneError,
    KVGroup,
    LeaseError,
    LeaseId,
    RequestId,
    TransferError,
    TransferTimeoutError,
    WireError,
)


class Client:
    def __init__(self) -> None:
        self.released: list[LeaseId] = []

    def release(self, lease: LeaseId, timeout_s: float) -> bool:
        self.released.append(lease)
        return True


class Peer:
    def __init__(self) -> None:
        self.client = Client()
        self.rank = 0


class Links:
    """Records what the loader does to its links."""

    def __init__(self) -> None:
        self.forgotten: list[Any] = []
        self.dropped: list[Any] = []

    def forget(self, engine: str, peer: Any) -> None:
        self.forgotten.append(peer)

    def drop(self, peer: Any) -> None:
        self.dropped.append(peer)

    def restarted(self, load: BlockLoad, peer: Any) -> bool:
        return False


class Now:
    """An executor that runs each job at once (the loader's release thread, made
    synchronous so the test sees what it did)."""

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(fn(*args))
        return done


def _fail(exc: Exception) -> tuple[Links, Peer]:
    loader = RemoteLoader.__new__(RemoteLoader)
    links = Links()
    loader.config = ConnectorConfig(engine_id="decode")
    loader._links = links  # type: ignore[assignment]
    loader._releases = Now()  # type: ignore[assignment]
    ids = {KVGroup.SELF: [BlockId(0), BlockId(1)]}
    job = Attempt(BlockLoad(RequestId("r"), "p", "a:1", ids, ids, "c" * 32))
    peer = Peer()
    job.peer, job.lease = peer, LeaseId("lease-1")  # type: ignore[assignment]
    result = loader._failed(job, exc, True)
    assert result.bad_block_ids == (0, 1) and result.error  # every block recomputed, always
    assert peer.client.released == ["lease-1"]  # and the lease given back, either way
    return links, peer


@pytest.mark.parametrize(
    "exc",
    [
        LeaseError("Pin: lease 7 is not held"),
        ControlPlaneError("Pin: too many pins", code="RESOURCE_EXHAUSTED"),
        ControlPlaneError("Pin: bad hashes", code="INVALID_ARGUMENT"),
        ControlPlaneError("Pin: not this identity's lease", code="PERMISSION_DENIED"),
    ],
    ids=lambda e: type(e).__name__ + "-" + getattr(e, "code", ""),
)
def test_a_refusal_the_owner_answered_keeps_the_link(exc: Exception) -> None:
    links, _ = _fail(exc)
    assert links.forgotten == [] and links.dropped == []


@pytest.mark.parametrize(
    "exc",
    [
        TransferError("READ failed"),
        TransferTimeoutError("READ did not finish"),
        ControlPlaneError("Pin: deadline", code="DEADLINE_EXCEEDED"),
        ControlPlaneError("Pin: connection refused", code="UNAVAILABLE"),
        WireError("Pin answer: blocks without a lease"),
        RuntimeError("a bug"),
    ],
    ids=lambda e: type(e).__name__ + "-" + getattr(e, "code", ""),
)
def test_a_failure_that_may_be_the_link_drops_it(exc: Exception) -> None:
    links, peer = _fail(exc)
    assert links.forgotten == [peer] and links.dropped == [peer]

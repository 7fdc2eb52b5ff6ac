"""The scheduler's offload lookup with tensor parallelism asks every rank.

Each TP rank stores and loads its own slice of a block under its own key in the daemon
(``pool_key(tp_rank, hash)``). The scheduler plans one load for all ranks, so its lookup
must answer the prefix *every* rank holds: a block that only rank 0 stored is a miss
(the request recomputes it), never a load that rank 1 cannot satisfy. A real daemon
service (handlers over a transport that moves no bytes) on loopback gRPC; the stores are
committed through the handlers directly, the lookup goes over the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import pytest

from kvbridge.connector.control.types import PeerInfo, Role, peer_to_pb
from kvbridge.connector.offload import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.offload.wire import store_notification
from kvbridge.proto import BlockHash, ConfigError, EngineId, preset_layout
from kvbridge.proto import offload_pb2 as pb
from kvbridge.worker.offload import OffloadConfig, OffloadServer, serve
from tests.harness.offload import FakeTransport

TP = 2
NAMES = [BlockHash(hashlib.sha256(bytes([i])).digest()) for i in range(4)]


class Ranks:
    """A daemon whose pool is a TP=2 layout, and one handshaken session per rank."""

    def __init__(self) -> None:
        self.transport = FakeTransport()
        layout = preset_layout("tiny", num_blocks=16, tp_rank=0, tp_size=TP)
        self.server: OffloadServer = serve(
            self.transport,  # type: ignore[arg-type]
            OffloadConfig(capacity_bytes=16 * layout.block_bytes()),
        )
        self.h = self.server.handlers
        self.sessions: list[str] = []
        for rank in range(TP):
            own = preset_layout("tiny", num_blocks=16, tp_rank=rank, tp_size=TP)
            peer = PeerInfo(EngineId(f"w-tp{rank}"), Role.BOTH, own, b"md")
            req = pb.OffloadHandshakeRequest(peer=peer_to_pb(peer), agent_name=f"w-tp{rank}")
            self.sessions.append(self.h.handshake(req).session)

    def store(self, rank: int, hashes: Sequence[BlockHash]) -> None:
        session = self.sessions[rank]
        prep = self.h.prepare_store(
            pb.PrepareStoreRequest(
                instance=self.h.instance, tp_rank=rank, hashes=list(hashes), session=session
            )
        )
        self.transport.notify(f"w-tp{rank}", store_notification(prep.store_id))
        self.h.commit_store(
            pb.CommitStoreRequest(
                store_id=prep.store_id, session=session, digests=[bytes(16)] * len(prep.slots)
            )
        )

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def ranks() -> Iterator[Ranks]:
    daemon = Ranks()
    try:
        yield daemon
    finally:
        daemon.close()


def _lookup(daemon: Ranks, tp_size: int) -> OffloadLookup:
    return OffloadLookup(OffloadLookupConfig(daemon.server.address, tp_size=tp_size, backoff_s=0))


def test_a_block_one_rank_lacks_is_a_miss_for_the_request(ranks: Ranks) -> None:
    ranks.store(0, NAMES[:3])
    ranks.store(1, NAMES[:1])
    both, rank0 = _lookup(ranks, TP), _lookup(ranks, 1)
    try:
        # rank 0 alone holds 3: asking as rank 0 only (the old lookup) would plan 3 blocks
        # that rank 1 then fails to load
        assert rank0(NAMES) == 3
        assert both(NAMES) == 1
        ranks.store(1, NAMES[:4])
        assert both(NAMES) == 3  # now rank 0 is the shorter one
        ranks.store(0, NAMES[3:])
        assert both(NAMES) == 4
    finally:
        both.close()
        rank0.close()


def test_a_rank_the_daemon_does_not_know_is_a_miss_not_an_error(ranks: Ranks) -> None:
    ranks.store(0, NAMES)
    ranks.store(1, NAMES)
    wrong = _lookup(ranks, TP + 1)  # rank 2 is outside the pool's TP size: refused
    try:
        assert wrong(NAMES) == 0
    finally:
        wrong.close()


def test_tp_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="tp_size must be >= 1"):
        OffloadLookupConfig("127.0.0.1:1", tp_size=0)

"""A real PeerControl server over a hand-written block owner that counts every pin, for the
control-plane tests (``start_cluster`` / ``stop_cluster``: the stop checks nothing leaked)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.control import (
    BlockOwner,
    ControlClient,
    ControlServer,
    ControlServerConfig,
    LeaseTable,
    PeerInfo,
    Role,
    serve,
)
from kvbridge.proto import (
    BlockHash,
    BlockId,
    EngineId,
    KVLayout,
    Negotiation,
)
from kvbridge.worker.block_pool import BlockPool


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.t += seconds


class FakeOwner(BlockOwner):
    """One BlockPool per group; remembers every pin it handed out and every bad unpin."""

    def __init__(self, layout: KVLayout) -> None:
        self.pools = {g.name: BlockPool(g.num_blocks) for g in layout.groups}
        self.lock = threading.Lock()
        self.pins: Counter[tuple[str, BlockId]] = Counter()
        self.errors: list[str] = []
        self.unpin_calls = 0

    def num_blocks(self, group: str) -> int:
        pool = self.pools.get(group)
        return 0 if pool is None else pool.num_blocks

    def pin_hashes(
        self, group_hashes: Mapping[str, Sequence[BlockHash]]
    ) -> dict[str, list[BlockId]]:
        with self.lock:
            out = {}
            for group, hashes in group_hashes.items():
                hits = self.pools[group].lookup_prefix(hashes)
                self.pools[group].touch(hits)
                self.pins.update((group, b) for b in hits)
                out[group] = hits
            return out

    def unpin(self, blocks: Mapping[str, Sequence[BlockId]]) -> None:
        with self.lock:
            self.unpin_calls += 1
            for group, ids in blocks.items():
                for b in ids:
                    if self.pins[(group, b)] <= 0:
                        self.errors.append(f"double unpin of {group}:{b}")
                    self.pins[(group, b)] -= 1
                self.pools[group].free(ids)

    # test helpers (the "engine" side)
    def fill(self, hashes: Sequence[BlockHash], group: str = "self") -> list[BlockId]:
        """Compute blocks for ``hashes`` and finish the request: cached, free, evictable."""
        with self.lock:
            pool = self.pools[group]
            ids = pool.allocate(len(hashes))
            for b, h in zip(ids, hashes, strict=True):
                assert pool.cache_block(b, h)
            pool.free(ids)
            return ids

    def take_for_request(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks of a finished request, still referenced (the owner pins them for a lease)."""
        with self.lock:
            pool = self.pools["self"]
            ids = pool.allocate(len(hashes))
            for b, h in zip(ids, hashes, strict=True):
                pool.cache_block(b, h)
            self.pins.update(("self", b) for b in ids)
            return ids

    def evict(self, n: int, group: str = "self") -> None:
        """Another request needs ``n`` blocks: the least recently freed are reused."""
        with self.lock:
            pool = self.pools[group]
            pool.free(pool.allocate(n))

    def is_full(self) -> bool:
        return all(p.num_free_blocks == p.num_blocks for p in self.pools.values())


def hashes(n: int, salt: int = 0) -> list[BlockHash]:
    return [BlockHash(bytes([salt, i]) * 8) for i in range(n)]


def peer(layout: KVLayout, engine: str = "decode-0", role: Role = Role.DECODE) -> PeerInfo:
    return PeerInfo(EngineId(engine), role, layout, agent_metadata=b"agent:" + engine.encode())


@dataclass
class Cluster:
    owner: FakeOwner
    clock: FakeClock
    server: ControlServer
    layout: KVLayout
    handshakes: list[tuple[PeerInfo, Negotiation]] = field(default_factory=list)
    clients: list[ControlClient] = field(default_factory=list)

    @property
    def leases(self) -> LeaseTable:
        return self.server.leases

    def client(self, **kwargs: object) -> ControlClient:
        kwargs.setdefault("timeout_s", 5.0)
        c = ControlClient(self.server.address, **kwargs)  # type: ignore[arg-type]
        self.clients.append(c)
        return c


def start_cluster(
    layout: KVLayout, config: ControlServerConfig | None = None, **hook_kwargs: object
) -> Cluster:
    owner = FakeOwner(layout)
    clock = FakeClock()
    table = LeaseTable(owner, clock=clock)
    seen: list[tuple[PeerInfo, Negotiation]] = []
    local = PeerInfo(EngineId("prefill-0"), Role.PREFILL, layout, agent_metadata=b"agent:prefill")
    server = serve(
        local, table, config or ControlServerConfig(), on_handshake=lambda p, n: seen.append((p, n))
    )
    return Cluster(owner, clock, server, layout, seen)


def stop_cluster(c: Cluster) -> None:
    for client in c.clients:
        client.close()
    held = len(c.leases)
    c.server.close()
    assert held == 0, f"test left {held} lease(s) held"
    assert c.owner.errors == []
    assert c.owner.is_full(), "pool not back to full"
    assert +c.owner.pins == Counter(), f"pins leaked: {+c.owner.pins}"

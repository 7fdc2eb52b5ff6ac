"""The reading engine's links to remote engines: one control client and transport links each.

:class:`LinkCache` belongs to :class:`~kvbridge.connector.load.RemoteLoader`
and is used from its load threads. A link is made once per engine (handshake
over gRPC, then ``Transport.connect`` to the peer's KV memory and, if it
publishes one, to its lease seal table, warmed by one READ of a seal slot so that
UCX's endpoint wireup is paid here, not by the first loads) and reused while the
engine answers at the same address. Peers the operator named are linked at
start (:meth:`LinkCache.connect_address`). The handshake runs on a small pool of its own (at most
``max_handshakes`` at once), started by :meth:`LinkCache.connect_ahead` as soon
as a step names a new engine; every load from that engine waits for that one
handshake, and a slow engine never holds up loads from the others. An address
in a request is a claim: the handshake must name the engine the request names,
and the peer must be the TP rank the load reads from, of the TP size the request
names (the client factory dials that rank's port, derived from the rank-0 address):
rank ``r`` of the same size, or under heterogeneous TP the rank(s)
:func:`~kvbridge.proto.negotiate.source_ranks` names. Links are kept per
(engine, remote rank).
A peer whose NIXL agent metadata changed after a failed load is a new process
under the same engine id (it restarted): the link is replaced and the load may
be retried once.

A peer whose inner order differs (``REARRANGE``) gets a staging cache in its
order (registered once per order) that blocks land in before conversion.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad
from kvbridge.connector.control.peers import nixl_agent_name
from kvbridge.connector.control.seal_reader import SealReader
from kvbridge.connector.load.rank_check import check_rank
from kvbridge.connector.transport.steps import LinkSteps, link_step, link_steps
from kvbridge.proto.errors import (
    KVBridgeError,
    OutOfBlocksError,
    PeerError,
    TransferTimeoutError,
)
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode
from kvbridge.proto.types import BlockId, EngineId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.control.client import ControlClient, HandshakeResult
    from kvbridge.connector.control.types import PeerInfo
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["ClientFactory", "LinkCache", "Peer", "STAGING_BLOCKS", "Staging"]

log = logging.getLogger(__name__)

ClientFactory = Callable[[str, int], "ControlClient"]
"""``(rank-0 address, remote TP rank)`` → a client for that rank's control port."""

EARLY_LINK_TRIES = 20
"""Handshakes tried with a peer named at start (pauses 0.5 s doubling to 5 s: ~1.5 min)."""
_NO_LINK = "no link to allowed peer %s yet (try %d; loads naming it recompute meanwhile): %s"
HANDSHAKE_STEP = "the handshake RPC (dial included)"
STAGING_BLOCKS = 256
"""Blocks of a REARRANGE staging cache (per remote order); a load needing more recomputes."""


@dataclass(slots=True)
class Staging:
    """A cache in a peer's order that blocks land in before conversion (REARRANGE)."""

    memory: LocalMemory
    caches: Mapping[str, torch.Tensor]
    free: dict[KVGroup, list[BlockId]]
    """Free staging blocks per group."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, group: KVGroup, n: int) -> list[BlockId]:
        with self.lock:
            free = self.free[group]
            if n > len(free):
                raise OutOfBlocksError(
                    f"REARRANGE staging has {len(free)} free {group!r} blocks, a load needs {n}"
                )
            taken, free[:] = free[:n], free[n:]
            return taken

    def give_back(self, group: KVGroup, slots: list[BlockId]) -> None:
        with self.lock:
            self.free[group].extend(slots)


@dataclass(slots=True)
class Peer:
    """Everything the reader holds for one remote engine."""

    client: ControlClient
    link: PeerLink
    address: str
    """The control address the handshake went to."""
    metadata: bytes
    """The peer's NIXL agent metadata: new on every start of the peer process."""
    staging: Staging | None = None
    seal_link: PeerLink | None = None
    """To the peer's lease seal table, if it publishes one (the no-RPC load)."""
    rank: int = 0
    """The peer's TP rank (its control port is the rank-0 address's port + ``rank``)."""
    warm_ms: float | None = None
    """How long the link's warm-up READ took while the link was made (None: not warmed,
    the peer publishes no seal table to read from)."""


class LinkCache:
    """Links to remote engines, by engine id; thread-safe."""

    def __init__(
        self,
        transport: Transport,
        client_factory: ClientFactory,
        local_info: Callable[[KVLayout], PeerInfo],
        memory: LocalMemory,
        kv_caches: Mapping[str, torch.Tensor],
        seal_reader: SealReader,
        *,
        max_handshakes: int = 1,
        handshake_wait_s: float = 15.0,
        warm_timeout_s: float = 5.0,
    ) -> None:
        self.transport = transport
        self._client_factory = client_factory
        self._local_info = local_info
        self._memory = memory
        self._kv_caches = kv_caches
        self._seal_reader = seal_reader
        self._staging: dict[tuple[str, ...], Staging] = {}
        self._staging_lock = threading.Lock()
        self._peers: dict[tuple[EngineId, int], Peer] = {}
        self._pending: dict[tuple[EngineId, int, str], tuple[Future[Peer], LinkSteps]] = {}
        """Handshakes in flight, by (engine, rank, address): loads from it wait for this one;
        with where it stands."""
        self._handshakes = ThreadPoolExecutor(max_handshakes, thread_name_prefix="kvb-handshake")
        self._wait_s = handshake_wait_s
        self._warm_s = warm_timeout_s
        self._closed = False
        self._stop = threading.Event()
        """Set at close: early links stop trying."""
        self._early: list[threading.Thread] = []
        self._lock = threading.Lock()

    def connect_ahead(self, load: BlockLoad, rank: int = 0) -> None:
        """Start the handshake with ``load``'s engine's TP rank ``rank`` unless it is linked
        at that address or a handshake is already on its way; never blocks (the engine's
        step calls it)."""
        if not load.remote_engine:
            return
        with self._lock:
            if not self._closed and self._cached(load, rank) is None:
                self._start(load, rank)

    def connect_address(self, address: str, ranks: Callable[[int], Sequence[int]]) -> None:
        """Link soon (own thread) to the engine at ``address``, a peer the operator named: its
        rank 0's handshake names the engine and TP size ``n``, then the ranks ``ranks(n)`` are
        linked as :meth:`connect_ahead` does. One not up yet is tried again (a load from it
        meanwhile links it as usual). Never blocks."""
        with self._lock:
            if self._closed:
                return
            thread = threading.Thread(
                target=self._connect_address, args=(address, ranks), name="kvb-early-link"
            )
            self._early.append(thread)
        thread.start()

    def _connect_address(self, address: str, ranks: Callable[[int], Sequence[int]]) -> None:
        pause = 0.5
        for attempt in range(1, EARLY_LINK_TRIES + 1):
            try:
                client = self._client_factory(address, 0)
                try:
                    hs = client.handshake(self._local_info(self._memory.layout))
                finally:
                    client.close()
                break
            except Exception as exc:  # not up yet, refused, ...
                last = attempt == EARLY_LINK_TRIES  # then a load naming it links again
                log.log(logging.WARNING if last else logging.INFO, _NO_LINK, address, attempt, exc)
                if last or self._stop.wait(pause):
                    return
                pause = min(2 * pause, 5.0)
        size = hs.peer.layout.tp_size
        load = BlockLoad(RequestId(""), hs.peer.engine_id, address, {}, {}, remote_tp_size=size)
        for rank in ranks(size):
            self.connect_ahead(load, rank)

    def get(self, load: BlockLoad, rank: int = 0) -> tuple[Peer, bool]:
        """The link to ``load``'s engine and whether it was cached; handshakes (again) when
        there is none or the engine now answers at another address (it restarted or moved),
        or waits for the handshake :meth:`connect_ahead` started."""
        with self._lock:
            peer = self._cached(load, rank)
            if peer is not None:
                return peer, True
            if self._closed:
                raise PeerError("the link cache is closed")
            pending, steps = self._start(load, rank)
        try:
            return pending.result(timeout=self._wait_s), False
        except FutureTimeout:
            raise TransferTimeoutError(
                f"no handshake with {load.remote_engine} (TP rank {rank}) at "
                f"{load.remote_address} in {self._wait_s:.1f}s: {steps.stuck()}"
            ) from None
        except CancelledError:
            raise PeerError("the link cache closed during the handshake") from None

    def cached(self, load: BlockLoad, rank: int = 0) -> Peer | None:
        """The link to ``load``'s engine's rank ``rank`` if made (never handshakes, no lock)."""
        return self._cached(load, rank)

    def _cached(self, load: BlockLoad, rank: int) -> Peer | None:
        peer = self._peers.get((EngineId(load.remote_engine), rank))
        return peer if peer is not None and peer.address == load.remote_address else None

    def _start(self, load: BlockLoad, rank: int) -> tuple[Future[Peer], LinkSteps]:
        """The handshake with ``load``'s engine's rank ``rank`` at its address, started if
        none is pending (call with the lock held)."""
        key = (EngineId(load.remote_engine), rank, load.remote_address)
        pending = self._pending.get(key)
        if pending is None:
            steps = LinkSteps("waiting for a handshake thread", always=HANDSHAKE_STEP)
            future = self._handshakes.submit(self._connect, load, rank, steps)
            pending = self._pending[key] = (future, steps)
        return pending

    def _connect(self, load: BlockLoad, rank: int, steps: LinkSteps) -> Peer:
        """Handshake and link on the handshake pool; the new link replaces the engine's old
        one only once the engine proved itself."""
        engine = (EngineId(load.remote_engine), rank)
        key = (EngineId(load.remote_engine), rank, load.remote_address)
        try:
            with link_steps(steps.enter):
                steps.enter(HANDSHAKE_STEP)
                client, hs = self._handshake(load, rank)
                fresh = self._link(load, client, hs, rank)
                steps.enter("done")
            log.info("link to %s (TP rank %d) made: %s", load.remote_engine, rank, steps.done())
        except BaseException:
            with self._lock:
                self._pending.pop(key, None)
            raise
        with self._lock:
            self._pending.pop(key, None)
            old = self._peers.get(engine)
            self._peers[engine] = fresh
        if old is not None:
            self.drop(old)
        return fresh

    def restarted(self, load: BlockLoad, failed: Peer) -> bool:
        """After a load through a cached link failed: handshake again, and if the engine's
        NIXL agent metadata changed (a new process under the same engine id), replace the
        link. True when there is a new link to retry the load on."""
        engine = (EngineId(load.remote_engine), failed.rank)
        try:
            with self._lock:
                current = self._peers.get(engine)
                if current is not None and current is not failed:
                    return current.metadata != failed.metadata  # another load replaced it
                client, hs = self._handshake(load, failed.rank)
                if hs.peer.agent_metadata == failed.metadata:
                    client.close()
                    return False  # the same process: the failure was real
                self.drop(failed)
                self._peers[engine] = self._link(load, client, hs, failed.rank)
        except Exception as exc:
            log.info("re-handshake with %s failed: %s", load.remote_engine, exc)
            return False
        log.info("%s restarted (new NIXL agent metadata); re-handshaken", load.remote_engine)
        return True

    def forget(self, engine: str, peer: Peer) -> None:
        """Stop using ``peer`` for new loads (the caller drops it)."""
        key = (EngineId(engine), peer.rank)
        with self._lock:
            if self._peers.get(key) is peer:
                del self._peers[key]

    def drop(self, peer: Peer) -> None:
        """Disconnect ``peer``'s links and close its client."""
        for link in (peer.seal_link, peer.link):
            if link is None:
                continue
            try:
                self.transport.disconnect(link)
            except KVBridgeError as exc:
                log.debug("disconnect: %s", exc)
        peer.client.close()

    def close(self) -> None:
        """Stop the handshakes, drop every link and client and unregister the staging
        caches."""
        with self._lock:
            self._closed = True
        self._stop.set()
        for thread in self._early:
            thread.join()  # its handshake is under the control deadline
        self._handshakes.shutdown(wait=True, cancel_futures=True)  # each under its deadline
        with self._lock:
            peers, self._peers = self._peers, {}
        for peer in peers.values():
            self.drop(peer)
        for staging in self._staging.values():
            self.transport.unregister(staging.memory)
        self._staging.clear()

    def _handshake(self, load: BlockLoad, rank: int) -> tuple[ControlClient, HandshakeResult]:
        """Handshake with TP rank ``rank`` of the engine at ``load.remote_address``; the
        answer must name the engine the load names (an address in a request is a claim, the
        handshake is the proof) and be that rank of the TP size the load names."""
        client = self._client_factory(load.remote_address, rank)
        try:
            hs = client.handshake(self._local_info(self._memory.layout))
            if hs.peer.engine_id != load.remote_engine:
                raise PeerError(
                    f"{load.remote_address} is engine {hs.peer.engine_id!r}, but the request "
                    f"names {load.remote_engine!r}; not reading from it"
                )
            check_rank(self._memory.layout, hs.peer.layout, client.address, load, rank)
        except BaseException:
            client.close()
            raise
        return client, hs

    def _link(self, load: BlockLoad, client: ControlClient, hs: HandshakeResult, rank: int) -> Peer:
        """Connect the transport to a handshaken peer and warm the link (a READ of one seal
        slot); closes ``client`` and disconnects on failure."""
        made: list[PeerLink] = []
        try:
            staging = None
            target = self._memory
            if hs.negotiation.mode is TransferMode.REARRANGE:
                staging = self._staging_for(hs.peer.layout)
                target = staging.memory
            remote = hs.peer.layout
            agent = nixl_agent_name(hs.peer.engine_id, remote.tp_rank, remote.tp_size)
            link_step("connecting the transport")
            link = self.transport.connect(agent, hs.peer.agent_metadata, remote, target)
            made.append(link)
            seal_link = None
            if hs.peer.seal_layout is not None:
                link_step("connecting the seal table link")
                try:
                    seal_link = self._seal_reader.connect(
                        agent, hs.peer.agent_metadata, hs.peer.seal_layout
                    )
                except KVBridgeError as exc:  # no fast path with this peer, still correct
                    log.warning("no seal link to %s: %s", hs.peer.engine_id, exc)
            warm_ms = None
            if seal_link is not None:
                made.append(seal_link)
                # the endpoint's wireup: here, once, not inside the first loads' READs
                link_step("the warm-up READ of a seal slot")
                warm_ms = self._seal_reader.warm(seal_link, self._warm_s) * 1e3
        except BaseException:
            for made_link in made:
                with contextlib.suppress(KVBridgeError):
                    self.transport.disconnect(made_link)
            client.close()
            raise
        log.info(
            "connected to %s at %s (%s, warm-up READ %s)",
            hs.peer.engine_id,
            client.address,  # a TP rank's own port, derived from the request's rank-0 address
            hs.negotiation.mode.value,
            "none" if warm_ms is None else f"{warm_ms:.1f} ms",
        )
        md = hs.peer.agent_metadata
        return Peer(client, link, load.remote_address, md, staging, seal_link, rank, warm_ms)

    def _staging_for(self, remote: KVLayout) -> Staging:
        """The staging cache in ``remote``'s order (made and registered once per order)."""
        with self._staging_lock:
            staging = self._staging.get(remote.order)
            if staging is None:
                local = self._memory.layout
                counts = {g.name: min(g.num_blocks, STAGING_BLOCKS) for g in local.groups}
                layout = local.with_order(remote.order).with_num_blocks(**counts)
                caches = layout.allocate(next(iter(self._kv_caches.values())).device.type)
                memory = self.transport.register(layout, caches)
                free = {g: [BlockId(i) for i in range(n)] for g, n in counts.items()}
                staging = self._staging[remote.order] = Staging(memory, caches, free)
            return staging

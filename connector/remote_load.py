"""Reading a remote engine's blocks: the load path of the worker half, fail closed.

One :class:`RemoteLoader` per engine process (owned by ``KVBridgeWorker``, called
from its load threads) keeps a control client and transport links per remote
engine. A load takes the **fast path** (READ the claimed ids, then the lease's
seal: no control RPC, the lease goes back by notification) or, without a good
seal, the **slow path** (the owner names the blocks for decode's own names; the
release answer confirms the lease never lapsed). The protocol and its proof:
:mod:`kvbridge.connector.control.seal` and docs/DESIGN-NOTES.md ("Trust").
READs land in the KV cache or, for a peer with another inner order
(``REARRANGE``), in a staging cache converted by :func:`kvbridge.kernels.convert_blocks`.
``self`` blocks not read whole are reported bad; cross blocks are all or nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.seal import SealReader
from kvbridge.kernels import BlockMapping, convert_blocks
from kvbridge.proto.errors import KVBridgeError, LeaseError, OutOfBlocksError, WireError
from kvbridge.proto.negotiate import TransferMode
from kvbridge.proto.types import BlockId, EngineId, LeaseId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.control.client import ControlClient
    from kvbridge.connector.control.types import PeerInfo
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["ClientFactory", "RemoteLoader"]

log = logging.getLogger(__name__)

ClientFactory = Callable[[str], "ControlClient"]


RELEASE_TIMEOUT_S = 1.0
"""Deadline of one lease release (a release lost on the way lets the lease expire)."""

STAGING_BLOCKS = 256
"""Blocks of a REARRANGE staging cache (per remote order); a load needing more recomputes."""


@dataclass(slots=True)
class _Staging:
    """A cache in a peer's order that blocks land in before conversion (REARRANGE)."""

    memory: LocalMemory
    caches: Mapping[str, torch.Tensor]
    free: dict[str, list[BlockId]]
    """Free staging blocks per group."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, group: str, n: int) -> list[BlockId]:
        with self.lock:
            free = self.free[group]
            if n > len(free):
                raise OutOfBlocksError(
                    f"REARRANGE staging has {len(free)} free {group!r} blocks, a load needs {n}"
                )
            taken, free[:] = free[:n], free[n:]
            return taken

    def give_back(self, group: str, slots: list[BlockId]) -> None:
        with self.lock:
            self.free[group].extend(slots)


@dataclass(slots=True)
class _Peer:
    client: ControlClient
    link: PeerLink
    staging: _Staging | None = None
    seal_link: PeerLink | None = None
    """To the peer's lease seal table, if it publishes one (the no-RPC load)."""


class RemoteLoader:
    """Loads from remote engines for one engine process; thread-safe."""

    def __init__(
        self,
        config: ConnectorConfig,
        transport: Transport,
        client_factory: ClientFactory,
        local_info: Callable[[KVLayout], PeerInfo],
        memory: LocalMemory,
        kv_caches: Mapping[str, torch.Tensor],
    ) -> None:
        self.config = config
        self.transport = transport
        self._client_factory = client_factory
        self._local_info = local_info
        self.memory = memory
        self.kv_caches = kv_caches
        self._seal_reader = SealReader(transport, config.max_concurrent_loads)
        self._staging: dict[tuple[str, ...], _Staging] = {}
        self._peers: dict[EngineId, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="kvb-release")
        """Releases after a failed load and disconnects run here, off the request's path."""

    def close(self) -> None:
        """Drop every link and client and unregister the staging and scratch memory."""
        self._releases.shutdown(wait=True)  # each is short (RELEASE_TIMEOUT_S)
        with self._peers_lock:
            peers, self._peers = self._peers, {}
        for peer in peers.values():
            self._drop(peer)
        for staging in self._staging.values():
            self.transport.unregister(staging.memory)
        self._staging.clear()
        self._seal_reader.close()

    def load(self, load: BlockLoad) -> LoadResult:
        """Load ``load``'s blocks from its remote engine; never raises (fail closed)."""
        groups = [g for g in ("self", "cross") if load.local_ids.get(g)]
        local = {g: list(load.local_ids[g]) for g in groups}
        remote = {g: list(load.remote_ids.get(g, ())) for g in groups}
        local_self = local.get("self", [])
        t0 = time.perf_counter()
        lease: LeaseId | None = LeaseId(load.lease_id) if load.lease_id else None
        peer: _Peer | None = None
        try:
            peer = self._peer(load)
            if self.config.stall_before_read_s:
                time.sleep(self.config.stall_before_read_s)
            sealed = self._load_sealed(peer, load, local, remote, t0)
            if sealed is not None:
                return sealed
            lease, remote = self._owner_blocks(peer, load, lease, local)
            moved: dict[str, int] = {}
            reads: list[tuple[int, int]] = []
            n = len(remote.get("self", ()))
            if n:
                reads.append(self._read(peer, "self", local_self[:n], remote["self"][:n]))
            moved["self"] = n
            bad, error = (
                local_self[n:],
                "" if n == len(local_self) else "lease expired: partial prefix",
            )
            if "cross" in groups:
                if len(remote["cross"]) == len(local["cross"]):
                    reads.append(self._read(peer, "cross", local["cross"], remote["cross"]))
                    moved["cross"] = len(local["cross"])
                else:  # all or nothing: the engine recomputes the whole request
                    bad, error = local_self, "cross blocks no longer held by the peer"
            if not self._release(peer, lease):
                # the lease lapsed at some moment before the owner confirmed the read: the
                # blocks may have been reused under it. Recompute; never cache them.
                moved = {}
                bad, error = local_self + local.get("cross", []), "lease lapsed during the read"
                log.warning("request %s: %s; recomputing", load.request_id, error)
            ms = (time.perf_counter() - t0) * 1e3
            return LoadResult(
                load.request_id,
                sum(len(ids) for ids in local.values()),
                sum(moved.values()),
                tuple(bad),
                ms,
                error,
                moved,
                sum(r[0] for r in reads),
                descriptors=sum(r[1] for r in reads),
                path="owner",
            )
        except Exception as exc:
            if isinstance(exc, KVBridgeError):
                log.warning(
                    "request %s: load from %s failed: %s", load.request_id, load.remote_engine, exc
                )
            else:  # a bug must still fail closed and give the pin back, not hang the request
                log.exception("request %s: unexpected load failure", load.request_id)
            if peer is not None:
                self._forget(load.remote_engine, peer, lease)
            ms = (time.perf_counter() - t0) * 1e3
            return LoadResult(
                load.request_id,
                sum(len(ids) for ids in local.values()),
                0,
                tuple(local_self),
                ms,
                str(exc) or repr(exc),
            )

    def _read(
        self, peer: _Peer, group: str, local: list[BlockId], remote: list[BlockId]
    ) -> tuple[int, int]:
        """READ ``remote`` into ``local`` (through the staging cache if the orders differ);
        returns ``(bytes, descriptors)`` read."""
        staging = peer.staging
        if staging is None:
            return self._read_into(peer, group, local, remote)
        assert self.memory is not None
        slots = staging.take(group, len(remote))  # OutOfBlocksError: the request recomputes
        try:
            read = self._read_into(peer, group, slots, remote)
            convert_blocks(
                staging.caches,
                staging.memory.layout,
                self.kv_caches,
                self.memory.layout,
                BlockMapping(slots, local),
                group=group,
            )
        finally:
            staging.give_back(group, slots)
        return read

    def _read_into(
        self, peer: _Peer, group: str, local: list[BlockId], remote: list[BlockId]
    ) -> tuple[int, int]:
        handle = self.transport.read_blocks(
            peer.link, group, local, remote, timeout_s=self.config.load_timeout_s
        )
        try:
            handle.wait(self.config.load_timeout_s)
            return handle.nbytes, handle.num_descriptors
        finally:
            handle.release()

    def _staging_for(self, remote: KVLayout) -> _Staging:
        """The staging cache in ``remote``'s order (made and registered once per order)."""
        assert self.memory is not None
        staging = self._staging.get(remote.order)
        if staging is None:
            local = self.memory.layout
            counts = {g.name: min(g.num_blocks, STAGING_BLOCKS) for g in local.groups}
            layout = local.with_order(remote.order).with_num_blocks(**counts)
            caches = layout.allocate(next(iter(self.kv_caches.values())).device.type)
            memory = self.transport.register(layout, caches)
            free = {g: [BlockId(i) for i in range(n)] for g, n in counts.items()}
            staging = self._staging[remote.order] = _Staging(memory, caches, free)
        return staging

    def _peer(self, load: BlockLoad) -> _Peer:
        engine = EngineId(load.remote_engine)
        with self._peers_lock:
            peer = self._peers.get(engine)
            if peer is not None:
                return peer
            assert self.memory is not None, "register_kv_caches was not called"
            client = self._client_factory(load.remote_address)
            try:
                hs = client.handshake(self._local_info(self.memory.layout))
                staging = None
                target = self.memory
                if hs.negotiation.mode is TransferMode.REARRANGE:
                    staging = self._staging_for(hs.peer.layout)
                    target = staging.memory
                link = self.transport.connect(
                    hs.peer.engine_id, hs.peer.agent_metadata, hs.peer.layout, target
                )
                seal_link = None
                if hs.peer.seal_layout is not None and self._seal_reader is not None:
                    try:
                        seal_link = self._seal_reader.connect(
                            hs.peer.engine_id, hs.peer.agent_metadata, hs.peer.seal_layout
                        )
                    except KVBridgeError as exc:  # no fast path with this peer, still correct
                        log.warning("no seal link to %s: %s", engine, exc)
            except BaseException:
                client.close()
                raise
            peer = self._peers[engine] = _Peer(client, link, staging, seal_link)
            log.info(
                "connected to %s at %s (%s)", engine, load.remote_address, hs.negotiation.mode.value
            )
            return peer

    def _load_sealed(
        self,
        peer: _Peer,
        load: BlockLoad,
        local: Mapping[str, list[BlockId]],
        remote: Mapping[str, list[BlockId]],
        t0: float,
    ) -> LoadResult | None:
        """The load without a control RPC: READ the claimed ids, then the lease's seal; a
        seal that holds proves them (see :mod:`kvbridge.connector.control.seal`) and the
        lease goes back by notification. None: no seal to check, or it did not hold (the
        caller then asks the owner, and reads again what the owner names)."""
        reader, link = self._seal_reader, peer.seal_link
        if not load.lease_id or not load.seal or reader is None or link is None:
            return None
        if any(len(remote[g]) != len(local[g]) for g in local):
            return None
        reads = [self._read(peer, g, local[g], remote[g]) for g in local]
        if not reader.holds(link, load.lease_id, load.seal, self.config.load_timeout_s):
            log.info(
                "request %s: the lease's seal does not hold; asking its owner", load.request_id
            )
            return None
        reader.release(link, load.lease_id)
        moved = {g: len(ids) for g, ids in local.items()}
        return LoadResult(
            load.request_id,
            sum(moved.values()),
            sum(moved.values()),
            (),
            (time.perf_counter() - t0) * 1e3,
            "",
            moved,
            sum(r[0] for r in reads),
            descriptors=sum(r[1] for r in reads),
            path="sealed",
        )

    def _owner_blocks(
        self,
        peer: _Peer,
        load: BlockLoad,
        lease: LeaseId | None,
        local: Mapping[str, list[BlockId]],
    ) -> tuple[LeaseId | None, dict[str, list[BlockId]]]:
        """The remote ids to read, as the blocks' owner names them: ``(lease, ids per group)``.

        Block ids in ``kv_transfer_params`` are a router's claim and never read.
        The owner answers with its lease for the request (extending it), and its
        names for those blocks must be exactly the names this engine computed
        from its own prompt. If the lease is gone, the longest prefix the owner
        still holds under those names is pinned anew (the rest is recomputed).
        """
        ttl = self.config.lease_ttl_s
        groups = list(local)
        pinned = None
        if lease is not None and load.remote_request_id:
            try:
                pinned = peer.client.pin_request(RequestId(load.remote_request_id), ttl_s=ttl)
            except LeaseError:
                log.info("request %s: the owner's lease is gone", load.request_id)
        if pinned is not None and pinned.lease_id is not None:
            remote: dict[str, list[BlockId]] = {}
            for g in groups:
                first = load.first_block if g == "self" else 0
                want = tuple(load.remote_hashes.get(g, ()))
                names = tuple(pinned.hashes.get(g, ()))[first : first + len(want)]
                ids = list(pinned.blocks.get(g, ()))[first : first + len(local[g])]
                if names != want or len(ids) != len(local[g]):
                    self._release(peer, pinned.lease_id)
                    raise WireError(
                        f"the owner's lease for request {load.remote_request_id!r} holds other "
                        f"{g!r} blocks than this prompt's (forged or mismatched params)"
                    )
                remote[g] = ids
            return pinned.lease_id, remote
        # no lease (expired, released, or never made): pin what is still there by name
        hashes = {g: list(load.remote_hashes.get(g, ())) for g in groups}
        again = peer.client.pin_hashes(hashes, ttl_s=ttl)
        remote = {g: list(again.blocks.get(g, ())) for g in groups}
        log.info(
            "request %s: lease gone; %s blocks still pinned",
            load.request_id,
            {g: f"{len(remote[g])}/{len(local[g])}" for g in groups},
        )
        return again.lease_id, remote

    def _release(self, peer: _Peer, lease: LeaseId | None) -> bool:
        """Give the lease back; True only if the owner still held it, which proves the blocks
        were not reused while they were read (leases never come back once lapsed). Under a
        short deadline: an owner that does not answer costs a recompute, not the answer."""
        if lease is None:
            return True  # nothing was read under a lease
        try:
            timeout = min(RELEASE_TIMEOUT_S, self.config.control_timeout_s)
            return peer.client.release(lease, timeout_s=timeout)
        except Exception as exc:  # e.g. a channel another load's failure closed: it expires
            log.info("release of lease %s failed (%s); it will expire", lease, exc)
            return False

    def _forget(self, engine: str, peer: _Peer, lease: LeaseId | None) -> None:
        """Stop using ``peer`` for new loads; release ``lease`` (nothing was read under it)
        and disconnect, off the request's path."""
        with self._peers_lock:
            if self._peers.get(EngineId(engine)) is peer:
                del self._peers[EngineId(engine)]
        self._releases.submit(self._release_and_drop, peer, lease)

    def _release_and_drop(self, peer: _Peer, lease: LeaseId | None) -> None:
        try:
            self._release(peer, lease)
        finally:
            self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        for link in (peer.seal_link, peer.link):
            if link is None:
                continue
            try:
                self.transport.disconnect(link)
            except KVBridgeError as exc:
                log.debug("disconnect: %s", exc)
        peer.client.close()

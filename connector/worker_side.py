"""kvbridge's worker half: pulls remote blocks into this engine's KV cache, fail closed.

Runs in the engine's worker thread (vLLM: each model-runner process). It owns
a :class:`~kvbridge.connector.transport.base.Transport` (injected: the transport lives
in ``kvbridge.worker``) and one control client per remote engine.

Each :class:`BlockLoad` of a step becomes a job on a small thread pool, so
``start_load_kv`` never blocks the engine on the network:

1. connect (handshake over gRPC, then ``Transport.connect``) unless a link to
   that engine is already up;
2. heartbeat the request's lease; if it is gone, pin the remote blocks again
   by hash, which yields the still-present prefix (maybe none);
3. READ the pinned blocks in one prepped transfer, under a deadline — straight
   into the KV cache, or, when the peer's inner order differs (``REARRANGE``),
   into a staging cache in the peer's order followed by
   :func:`kvbridge.kernels.convert_blocks`;
4. release the lease.

Each group of a load (``self``; ``cross`` for encoder-decoder models) is one
READ. ``self`` blocks that were not read whole are reported by
``get_block_ids_with_load_errors`` and the engine recomputes from the first
of them. Cross blocks are all or nothing: if any is missing or its read
fails, every ``self`` block of the load is reported too, so the engine treats
the load as failed and recomputes (cross KV included). Nothing here raises
into the engine's step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad, BlockStore, StepMetadata, WorkerConnector
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.seal import SealTable
from kvbridge.connector.seal_check import ReleaseListener, SealReader
from kvbridge.kernels import BlockMapping, convert_blocks
from kvbridge.proto.errors import KVBridgeError, LeaseError, OutOfBlocksError, WireError
from kvbridge.proto.negotiate import TransferMode
from kvbridge.proto.types import BlockHash, BlockId, EngineId, LeaseId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.control.client import ControlClient
    from kvbridge.connector.control.types import PeerInfo
    from kvbridge.connector.offload.client import OffloadClient, OffloadStoreResult
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["KVBridgeWorker", "LoadResult", "StoreCounts"]

log = logging.getLogger(__name__)

ClientFactory = Callable[[str], "ControlClient"]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one request's load did; kept for the engine's per-request report."""

    request_id: RequestId
    blocks_requested: int
    blocks_moved: int
    bad_block_ids: tuple[BlockId, ...]
    transfer_ms: float
    error: str = ""
    moved_by_group: Mapping[str, int] = field(default_factory=dict)
    """Blocks read per group (``self``, ``cross``)."""
    bytes_moved: int = 0
    """Bytes the transport read: only layers that own KV ever move."""
    blocks_offloaded: int = 0
    """``self`` blocks loaded from the CPU offload daemon (not counted in blocks_moved)."""


SEAL_SLOTS = 4096
"""Slots of an engine's lease seal table (64 bytes each): leases held at once, with room."""


@dataclass(frozen=True, slots=True)
class StoreCounts:
    """Offload stores this worker finished, by outcome (a failed store is never a success)."""

    succeeded: int = 0
    failed: int = 0
    blocks_stored: int = 0
    """Blocks the daemon committed (blocks it already held are not counted)."""


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


@dataclass(slots=True)
class _State:
    jobs: dict[RequestId, tuple[BlockLoad, Future[LoadResult]]] = field(default_factory=dict)
    stores: dict[RequestId, Future[OffloadStoreResult]] = field(default_factory=dict)
    bad: set[BlockId] = field(default_factory=set)
    results: dict[RequestId, LoadResult] = field(default_factory=dict)
    store_counts: StoreCounts = field(default_factory=StoreCounts)


class KVBridgeWorker(WorkerConnector):
    """The worker half; ``local_info`` builds this engine's handshake identity."""

    def __init__(
        self,
        config: ConnectorConfig,
        transport: Transport,
        client_factory: ClientFactory,
        local_info: Callable[[KVLayout], PeerInfo],
    ) -> None:
        self.config = config
        self.transport = transport
        self._client_factory = client_factory
        self._local_info = local_info
        self.memory: LocalMemory | None = None
        self.seal: SealTable | None = None
        """This engine's own lease seals (the owner's side), made at registration."""
        self._seal_memory: LocalMemory | None = None
        self._seal_reader: SealReader | None = None
        self._release_listener: ReleaseListener | None = None
        self.offload: OffloadClient | None = None
        self.kv_caches: Mapping[str, torch.Tensor] = {}
        self._staging: dict[tuple[str, ...], _Staging] = {}
        self._peers: dict[EngineId, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.max_concurrent_loads, thread_name_prefix="kvb-load")
        self._state = _State()

    # ----- WorkerConnector -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVLayout) -> None:
        self.memory = self.transport.register(layout, kv_caches)
        self.kv_caches = kv_caches
        self.seal = SealTable(SEAL_SLOTS)
        self._seal_memory = self.transport.register(self.seal.layout, self.seal.tensors)
        self._seal_reader = SealReader(self.transport, self.config.max_concurrent_loads)
        if self.config.offload_address:
            from kvbridge.connector.offload.client import OffloadClient, OffloadClientConfig

            timeout = self.config.load_timeout_s
            self.offload = OffloadClient(
                OffloadClientConfig(
                    address=self.config.offload_address,
                    engine_id=self.config.engine_id,
                    transfer_timeout_s=timeout,
                    ttl_s=max(2 * timeout, self.config.lease_ttl_s),
                ),
                self.transport,
                self.memory,
            )

    def start_load_kv(self, metadata: StepMetadata) -> None:
        for load in metadata.loads:
            self._state.jobs[load.request_id] = (load, self._pool.submit(self._load, load))
        for store in metadata.stores:
            self._state.stores[store.request_id] = self._pool.submit(self._store, store)

    @property
    def seal_layout(self) -> KVLayout | None:
        """The bound layout of this engine's seal table, for its handshake identity."""
        return None if self._seal_memory is None else self._seal_memory.layout

    def listen_for_releases(self, release: Callable[[LeaseId], object]) -> None:
        """Release leases that readers give back by notification (the owner's lease table's
        ``release``); stopped by :meth:`close`."""
        if self._release_listener is None:
            self._release_listener = ReleaseListener(self.transport, release)

    def offload_lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the offload daemon holds (0 without one, or on error)."""
        return 0 if self.offload is None else self.offload.lookup(hashes)

    def get_finished(
        self, finished_request_ids: set[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        done: set[RequestId] = set()
        for rid, (load, job) in list(self._state.jobs.items()):
            if not job.done():
                continue
            del self._state.jobs[rid]
            try:
                result = job.result()
            except Exception as exc:  # _load catches everything; this is the last line of defence
                log.exception("request %s: load job failed", rid)
                every = tuple(b for ids in load.local_ids.values() for b in ids)
                result = LoadResult(
                    rid, len(every), 0, tuple(load.local_ids.get("self", ())), 0.0, repr(exc)
                )
            self._state.results[rid] = result
            self._state.bad.update(result.bad_block_ids)
            done.add(rid)
        # a store that is over, failed or not, is reported once in done_sending: the engine
        # may free its blocks now (the daemon never publishes a block whose store failed)
        sent = {rid for rid, job in self._state.stores.items() if job.done()}
        for rid in sent:
            self._store_finished(rid, self._state.stores.pop(rid))
        return sent, done

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        bad, self._state.bad = self._state.bad, set()
        return bad

    # ----- reports and lifecycle -----------------------------------------------------------
    def pop_result(self, request_id: RequestId) -> LoadResult | None:
        """The load report of a request (once), for the per-request stats."""
        return self._state.results.pop(request_id, None)

    @property
    def store_counts(self) -> StoreCounts:
        """Offload stores reported in ``get_finished`` so far, by outcome."""
        return self._state.store_counts

    def close(self) -> None:
        if self._release_listener is not None:
            self._release_listener.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.offload is not None:
            self.offload.close()
        with self._peers_lock:
            peers, self._peers = self._peers, {}
        for peer in peers.values():
            self._drop(peer)
        for staging in self._staging.values():
            self.transport.unregister(staging.memory)
        self._staging.clear()
        if self._seal_reader is not None:
            self._seal_reader.close()
            self._seal_reader = None
        if self._seal_memory is not None:
            self.transport.unregister(self._seal_memory)
            self._seal_memory = None

    # ----- one store / load, on a pool thread ----------------------------------------------
    def _store(self, store: BlockStore) -> OffloadStoreResult:
        """WRITE a finished request's blocks to the offload daemon (best effort)."""
        assert self.offload is not None
        return self.offload.store(list(store.block_ids), list(store.hashes))

    def _store_finished(self, rid: RequestId, job: Future[OffloadStoreResult]) -> None:
        """Log and count a finished store job; a job that raised counts as failed."""
        counts = self._state.store_counts
        if job.cancelled():
            error = "cancelled before it ran (worker closing)"
        elif (exc := job.exception()) is not None:
            error = f"store job raised {exc!r}"
        else:
            result = job.result()
            error = result.error
            if not error:
                self._state.store_counts = replace(
                    counts,
                    succeeded=counts.succeeded + 1,
                    blocks_stored=counts.blocks_stored + result.stored,
                )
                log.debug(
                    "request %s: stored %d blocks, %d already held",
                    rid,
                    result.stored,
                    result.skipped,
                )
                return
        self._state.store_counts = replace(counts, failed=counts.failed + 1)
        log.warning("request %s: offload store failed: %s", rid, error)

    def _load(self, load: BlockLoad) -> LoadResult:
        """Blocks from the offload daemon first, the rest from the remote engine."""
        if not load.offload_hashes or self.offload is None:
            return self._load_remote(load)
        k = len(load.offload_hashes)
        local_self = list(load.local_ids["self"])
        got = self.offload.load(local_self[:k], list(load.offload_hashes))  # never raises
        m = got.loaded
        if not load.remote_engine:  # nothing to fall back on: recompute what is missing
            return LoadResult(
                load.request_id,
                k,
                0,
                tuple(local_self[m:k]),
                got.elapsed_s * 1e3,
                got.error if m < k else "",
                {},
                0,
                m,
            )
        # always go to the peer, if only to release the lease on what it pinned for us
        result = self._load_remote(_skip_self(load, m))
        return replace(
            result,
            blocks_requested=result.blocks_requested + m,
            transfer_ms=result.transfer_ms + got.elapsed_s * 1e3,
            blocks_offloaded=m,
        )

    def _load_remote(self, load: BlockLoad) -> LoadResult:
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
            nbytes = 0
            n = len(remote.get("self", ()))
            if n:
                nbytes += self._read(peer, "self", local_self[:n], remote["self"][:n])
            moved["self"] = n
            bad, error = (
                local_self[n:],
                "" if n == len(local_self) else "lease expired: partial prefix",
            )
            if "cross" in groups:
                if len(remote["cross"]) == len(local["cross"]):
                    nbytes += self._read(peer, "cross", local["cross"], remote["cross"])
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
                nbytes,
            )
        except Exception as exc:
            if isinstance(exc, KVBridgeError):
                log.warning(
                    "request %s: load from %s failed: %s", load.request_id, load.remote_engine, exc
                )
            else:  # a bug must still fail closed and give the pin back, not hang the request
                log.exception("request %s: unexpected load failure", load.request_id)
            if peer is not None:
                self._release(peer, lease)
                self._forget(load.remote_engine, peer)
            ms = (time.perf_counter() - t0) * 1e3
            return LoadResult(
                load.request_id,
                sum(len(ids) for ids in local.values()),
                0,
                tuple(local_self),
                ms,
                str(exc) or repr(exc),
            )

    def _read(self, peer: _Peer, group: str, local: list[BlockId], remote: list[BlockId]) -> int:
        """READ ``remote`` into ``local`` (through the staging cache if the orders differ);
        returns the bytes read."""
        staging = peer.staging
        if staging is None:
            return self._read_into(peer, group, local, remote)
        assert self.memory is not None
        slots = staging.take(group, len(remote))  # OutOfBlocksError: the request recomputes
        try:
            nbytes = self._read_into(peer, group, slots, remote)
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
        return nbytes

    def _read_into(
        self, peer: _Peer, group: str, local: list[BlockId], remote: list[BlockId]
    ) -> int:
        handle = self.transport.read_blocks(
            peer.link, group, local, remote, timeout_s=self.config.load_timeout_s
        )
        try:
            handle.wait(self.config.load_timeout_s)
            return handle.nbytes
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
        nbytes = sum(self._read(peer, g, local[g], remote[g]) for g in local)
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
            nbytes,
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
        were not reused while they were read (leases never come back once lapsed)."""
        if lease is None:
            return True  # nothing was read under a lease
        try:
            return peer.client.release(lease, timeout_s=self.config.control_timeout_s)
        except Exception as exc:  # e.g. a channel another load's failure closed: it expires
            log.info("release of lease %s failed (%s); it will expire", lease, exc)
            return False

    def _forget(self, engine: str, peer: _Peer) -> None:
        with self._peers_lock:
            if self._peers.get(EngineId(engine)) is peer:
                del self._peers[EngineId(engine)]
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


def _skip_self(load: BlockLoad, n: int) -> BlockLoad:
    """``load`` without its first ``n`` ``self`` blocks (they came from the offload daemon)."""
    if n == 0:
        return load
    local = dict(load.local_ids)
    remote = dict(load.remote_ids)
    hashes = dict(load.remote_hashes)
    local["self"] = tuple(load.local_ids["self"])[n:]
    remote["self"] = tuple(load.remote_ids.get("self", ()))[n:]
    hashes["self"] = tuple(load.remote_hashes.get("self", ()))[n:]
    return replace(
        load,
        local_ids=local,
        remote_ids=remote,
        remote_hashes=hashes,
        offload_hashes=(),
        first_block=load.first_block + n,
    )

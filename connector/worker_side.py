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
from kvbridge.kernels import BlockMapping, convert_blocks
from kvbridge.proto.errors import (
    ControlPlaneError,
    KVBridgeError,
    OutOfBlocksError,
    PeerError,
    TransferTimeoutError,
)
from kvbridge.proto.negotiate import TransferMode
from kvbridge.proto.types import BlockHash, BlockId, EngineId, LeaseId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.control.client import ControlClient, HandshakeResult
    from kvbridge.connector.control.types import PeerInfo
    from kvbridge.connector.offload.client import OffloadClient
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["KVBridgeWorker", "LoadResult"]

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
    address: str
    """The control address the handshake went to."""
    metadata: bytes
    """The peer's NIXL agent metadata: new on every start of the peer process."""
    staging: _Staging | None = None


@dataclass(slots=True)
class _State:
    jobs: dict[RequestId, tuple[BlockLoad, Future[LoadResult]]] = field(default_factory=dict)
    stores: dict[RequestId, Future[None]] = field(default_factory=dict)
    bad: set[BlockId] = field(default_factory=set)
    results: dict[RequestId, LoadResult] = field(default_factory=dict)


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
        sent = {rid for rid, job in self._state.stores.items() if job.done()}
        for rid in sent:
            del self._state.stores[rid]
        return sent, done

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        bad, self._state.bad = self._state.bad, set()
        return bad

    # ----- reports and lifecycle -----------------------------------------------------------
    def pop_result(self, request_id: RequestId) -> LoadResult | None:
        """The load report of a request (once), for the per-request stats."""
        return self._state.results.pop(request_id, None)

    def close(self) -> None:
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

    # ----- one store / load, on a pool thread ----------------------------------------------
    def _store(self, store: BlockStore) -> None:
        """WRITE a finished request's blocks to the offload daemon (best effort, never raises)."""
        assert self.offload is not None
        result = self.offload.store(list(store.block_ids), list(store.hashes))
        if result.error:
            log.info("request %s: offload store failed: %s", store.request_id, result.error)
        else:
            log.debug(
                "request %s: stored %d blocks, %d already held",
                store.request_id,
                result.stored,
                result.skipped,
            )

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

    def _load_remote(self, load: BlockLoad, *, retry_stale: bool = True) -> LoadResult:
        groups = [g for g in ("self", "cross") if load.local_ids.get(g)]
        local = {g: list(load.local_ids[g]) for g in groups}
        remote = {g: list(load.remote_ids.get(g, ())) for g in groups}
        local_self = local.get("self", [])
        t0 = time.perf_counter()
        lease: LeaseId | None = LeaseId(load.lease_id) if load.lease_id else None
        peer: _Peer | None = None
        cached = False
        try:
            peer, cached = self._peer(load)
            alive = peer.client.heartbeat([lease], ttl_s=self.config.lease_ttl_s) if lease else []
            if not alive:
                # the lease is gone: its blocks may be reused. Pin what is still there by hash.
                hashes = {g: list(load.remote_hashes.get(g, ())) for g in groups}
                pinned = peer.client.pin_hashes(hashes, ttl_s=self.config.lease_ttl_s)
                lease = pinned.lease_id
                remote = {g: list(pinned.blocks.get(g, ())) for g in groups}
                log.info(
                    "request %s: lease expired; %s blocks still pinned",
                    load.request_id,
                    {g: f"{len(remote[g])}/{len(local[g])}" for g in groups},
                )
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
            ms = (time.perf_counter() - t0) * 1e3
            self._release(peer, lease)
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
            if (
                peer is not None
                and cached
                and retry_stale
                and not _timed_out(exc)  # a hung peer, not a restarted one
                and self._restarted(load, peer)
            ):
                # the link was to an earlier process of this engine: try once more on the new one
                if lease is not None and lease != load.lease_id:
                    self._release(self._peers.get(EngineId(load.remote_engine), peer), lease)
                return self._load_remote(load, retry_stale=False)
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

    def _peer(self, load: BlockLoad) -> tuple[_Peer, bool]:
        """The link to ``load``'s engine and whether it was cached; handshakes (again) when
        there is none or the engine now answers at another address (it restarted or moved)."""
        engine = EngineId(load.remote_engine)
        with self._peers_lock:
            peer = self._peers.get(engine)
            if peer is not None and peer.address == load.remote_address:
                return peer, True
            client, hs = self._handshake(load)
            fresh = self._link(load, client, hs)
            if peer is not None:  # replaced only now that the engine proved itself
                self._drop(peer)
            self._peers[engine] = fresh
            return fresh, False

    def _restarted(self, load: BlockLoad, failed: _Peer) -> bool:
        """After a load through a cached link failed: handshake again, and if the engine's
        NIXL agent metadata changed (a new process under the same engine id), replace the
        link. True when there is a new link to retry the load on."""
        engine = EngineId(load.remote_engine)
        try:
            with self._peers_lock:
                current = self._peers.get(engine)
                if current is not None and current is not failed:
                    return current.metadata != failed.metadata  # another load replaced it
                client, hs = self._handshake(load)
                if hs.peer.agent_metadata == failed.metadata:
                    client.close()
                    return False  # the same process: the failure was real
                self._drop(failed)
                self._peers[engine] = self._link(load, client, hs)
        except Exception as exc:
            log.info("re-handshake with %s failed: %s", load.remote_engine, exc)
            return False
        log.info("%s restarted (new NIXL agent metadata); re-handshaken", load.remote_engine)
        return True

    def _handshake(self, load: BlockLoad) -> tuple[ControlClient, HandshakeResult]:
        """Handshake at ``load.remote_address``; the answer must name the engine the load
        names (an address in a request is a claim, the handshake is the proof)."""
        assert self.memory is not None, "register_kv_caches was not called"
        client = self._client_factory(load.remote_address)
        try:
            hs = client.handshake(self._local_info(self.memory.layout))
            if hs.peer.engine_id != load.remote_engine:
                raise PeerError(
                    f"{load.remote_address} is engine {hs.peer.engine_id!r}, but the request "
                    f"names {load.remote_engine!r}; not reading from it"
                )
        except BaseException:
            client.close()
            raise
        return client, hs

    def _link(self, load: BlockLoad, client: ControlClient, hs: HandshakeResult) -> _Peer:
        """Connect the transport to a handshaken peer (closes ``client`` on failure)."""
        assert self.memory is not None
        try:
            staging = None
            target = self.memory
            if hs.negotiation.mode is TransferMode.REARRANGE:
                staging = self._staging_for(hs.peer.layout)
                target = staging.memory
            link = self.transport.connect(
                hs.peer.engine_id, hs.peer.agent_metadata, hs.peer.layout, target
            )
        except BaseException:
            client.close()
            raise
        log.info(
            "connected to %s at %s (%s)",
            hs.peer.engine_id,
            load.remote_address,
            hs.negotiation.mode.value,
        )
        return _Peer(client, link, load.remote_address, hs.peer.agent_metadata, staging)

    def _release(self, peer: _Peer, lease: LeaseId | None) -> None:
        if lease is None:
            return
        try:
            peer.client.release(lease)
        except Exception as exc:  # e.g. a channel another load's failure closed: it expires
            log.info("release of lease %s failed (%s); it will expire", lease, exc)

    def _forget(self, engine: str, peer: _Peer) -> None:
        with self._peers_lock:
            if self._peers.get(EngineId(engine)) is peer:
                del self._peers[EngineId(engine)]
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        try:
            self.transport.disconnect(peer.link)
        except KVBridgeError as exc:
            log.debug("disconnect: %s", exc)
        peer.client.close()


def _timed_out(exc: Exception) -> bool:
    """Whether ``exc`` is a deadline that passed (the peer hangs; a restart fails fast)."""
    return isinstance(exc, TransferTimeoutError) or (
        isinstance(exc, ControlPlaneError) and exc.code == "DEADLINE_EXCEEDED"
    )


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
        load, local_ids=local, remote_ids=remote, remote_hashes=hashes, offload_hashes=()
    )

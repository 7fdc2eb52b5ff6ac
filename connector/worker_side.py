"""kvbridge's worker half: loads into this engine's KV cache, stores to the offload daemon.

Runs in the engine's worker thread (vLLM: each model-runner process). It owns
the engine's registration with a :class:`~kvbridge.connector.transport.Transport`
(injected), the engine's lease seal table (the owner's side of the no-RPC load,
:mod:`kvbridge.connector.control.seal`) and a listener for leases readers give
back by notification.

A :class:`BlockLoad` whose links are made is driven from the engine's own
thread: ``start_load_kv`` posts its READs and each ``get_finished`` polls it on,
never blocking (:mod:`kvbridge.connector.load.inline`: no hand-off of the
interpreter lock to another thread on a load's path). Any other load (a new
link, blocks from the offload daemon, the owner path, a retry) becomes a job on
a small thread pool, so ``start_load_kv`` never blocks the engine on the
network: blocks the offload daemon holds come from there first, the rest from
the remote engine (:class:`~kvbridge.connector.load.RemoteLoader` says how,
fail closed).
Each store becomes a job too, reported once in ``done_sending`` when over.
Nothing here raises into the engine's step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvbridge.connector.base import (
    BlockLoad,
    BlockStore,
    LoadResult,
    StepMetadata,
    WorkerConnector,
)
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.releases import ReleaseListener
from kvbridge.connector.control.seal import SealTable
from kvbridge.connector.daemon_share import daemon_blocks, skip_offloaded
from kvbridge.connector.load import ClientFactory, RemoteLoader, load_result
from kvbridge.connector.load.inline import INLINE_LOADS, SPIN_S
from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId, LeaseId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.control.types import PeerInfo
    from kvbridge.connector.load.inline import InlineLoad
    from kvbridge.connector.offload.client import (
        OffloadClient,
        OffloadLoadResult,
        OffloadStoreResult,
    )
    from kvbridge.connector.transport.base import LocalMemory, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["KVBridgeWorker", "LoadResult", "StoreCounts"]

log = logging.getLogger(__name__)
steps_log = logging.getLogger("kvbridge.connector.load.steps")
"""At DEBUG: one line per load, the time each of its steps took (see :func:`_log_steps`)."""


SEAL_SLOTS = 4096
"""Slots of an engine's lease seal table (64 bytes each): leases held at once, with room."""


@dataclass(frozen=True, slots=True)
class StoreCounts:
    """Offload stores this worker finished, by outcome (a failed store is never a success)."""

    succeeded: int = 0
    failed: int = 0
    blocks_stored: int = 0
    """Blocks the daemon committed (blocks it already held are not counted)."""


@dataclass(slots=True)
class _State:
    jobs: dict[RequestId, tuple[BlockLoad, Future[LoadResult]]] = field(default_factory=dict)
    inline: dict[RequestId, tuple[BlockLoad, InlineLoad]] = field(default_factory=dict)
    """Loads driven from the engine's thread (polled in ``get_finished``)."""
    started: dict[RequestId, float] = field(default_factory=dict)
    """When ``start_load_kv`` took each load under way (``time.perf_counter()``)."""
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
        self._remote: RemoteLoader | None = None
        self._release_listener: ReleaseListener | None = None
        self.offload: OffloadClient | None = None
        self.kv_caches: Mapping[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(config.max_concurrent_loads, thread_name_prefix="kvb-load")
        self._state = _State()

    # ----- WorkerConnector -----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVLayout) -> None:
        self.memory = self.transport.register(layout, kv_caches)
        self.kv_caches = kv_caches
        self.seal = SealTable(SEAL_SLOTS)
        self._seal_memory = self.transport.register(self.seal.layout, self.seal.tensors)
        self._remote = RemoteLoader(
            self.config,
            self.transport,
            self._client_factory,
            self._local_info,
            self.memory,
            kv_caches,
        )
        if self.config.consumes and self.config.allowed_peers:
            # the peers the operator named: linked now, so no load waits for the first link
            self._remote.connect_to(self.config.allowed_peers)
        if self.config.offload_address:
            from kvbridge.connector.offload.client import OffloadClient, OffloadClientConfig

            timeout = self.config.load_timeout_s
            self.offload = OffloadClient(
                OffloadClientConfig(
                    address=self.config.offload_address,
                    engine_id=self.config.engine_id,
                    token=self.config.token,
                    transfer_timeout_s=timeout,
                    ttl_s=max(2 * timeout, self.config.lease_ttl_s),
                    verify=self.config.offload_verify,
                ),
                self.transport,
                self.memory,
                kv_caches,
            )

    def start_load_kv(self, metadata: StepMetadata) -> None:
        if self._remote is not None:  # handshakes with new peers start now, once per peer
            self._remote.connect_ahead(metadata.loads)
        state = self._state
        for load in metadata.loads:
            state.started[load.request_id] = time.perf_counter()
            inline = None
            offload = bool(load.offload_hashes) and self.offload is not None
            if self._remote is not None and not offload and len(state.inline) < INLINE_LOADS:
                inline = self._remote.start(load)
            if inline is not None:
                state.inline[load.request_id] = (load, inline)
            else:
                state.jobs[load.request_id] = (load, self._pool.submit(self._load, load))
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

    def get_finished(
        self, finished_request_ids: set[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        done: set[RequestId] = set()
        remote, spin_until = self._remote, time.perf_counter() + SPIN_S
        if remote is not None:  # leases of loads reported before: off their timed path
            remote.send_releases(loads_in_flight=bool(self._state.inline))
        for rid, (load, inline) in list(self._state.inline.items()):
            assert remote is not None
            try:
                out = remote.advance(inline, spin_until)  # never blocks
            except Exception as exc:  # it catches everything; the last line of defence
                log.exception("request %s: inline load failed", rid)
                inline.close()
                bad = load.local_ids.get(KVGroup.SELF, ())
                out = load_result(load, 0.0, bad=bad, error=repr(exc), elapsed_ms=0.0)
            if out is None:
                continue
            del self._state.inline[rid]
            if callable(out):  # the owner path or a failure's handling: on the pool
                self._state.jobs[rid] = (load, self._pool.submit(out))
                continue
            self._finished(rid, out)
            done.add(rid)
        for rid, (load, job) in list(self._state.jobs.items()):
            if not job.done():
                continue
            del self._state.jobs[rid]
            try:
                result = job.result()
            except Exception as exc:  # _load catches everything; this is the last line of defence
                log.exception("request %s: load job failed", rid)
                result = load_result(
                    load,
                    0.0,
                    bad=load.local_ids.get(KVGroup.SELF, ()),
                    error=repr(exc),
                    elapsed_ms=0.0,
                )
            self._finished(rid, result)
            done.add(rid)
        # a store that is over, failed or not, is reported once in done_sending: the engine
        # may free its blocks now (the daemon never publishes a block whose store failed)
        sent = {rid for rid, job in self._state.stores.items() if job.done()}
        for rid in sent:
            self._store_finished(rid, self._state.stores.pop(rid))
        return sent, done

    def _finished(self, rid: RequestId, result: LoadResult) -> None:
        self._state.results[rid] = result
        self._state.bad.update(result.bad_block_ids)
        started = self._state.started.pop(rid, None)
        if started is not None and steps_log.isEnabledFor(logging.DEBUG):
            _log_steps(rid, started, result)

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
        for _, inline in self._state.inline.values():  # their leases expire
            inline.close()
        self._state.inline.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.offload is not None:
            self.offload.close()
        if self._remote is not None:
            self._remote.close()
            self._remote = None
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

    def _load_groups(self, load: BlockLoad) -> LoadResult:
        """A hybrid model's blocks from the offload daemon: the ``self`` blocks and each
        group's in one load (every group's blocks are ``self``-shaped pages), all or none,
        since a prefix of one group without the other's window is no prefix at all. With a
        remote engine the rest come from it (after a shortfall: every block); without one,
        a shortfall fails the whole load (every block recomputed)."""
        assert self.offload is not None
        ids, names = daemon_blocks(load)
        got = self.offload.load(ids, names)  # never raises
        ok = got.loaded == len(ids)
        if load.remote_engine:
            n = len(load.offload_hashes) if ok else 0
            return self._from_remote(skip_offloaded(load, n, groups=ok), got, len(ids) if ok else 0)
        return load_result(
            load,
            0.0,
            requested=len(ids),
            bad=() if ok else ids,
            error="" if ok else got.error or f"the daemon held {got.loaded} of {len(ids)} blocks",
            offloaded=got.loaded if ok else 0,
            elapsed_ms=got.elapsed_s * 1e3,
            offload_bad_digest=got.bad_digest,
        )

    def _load(self, load: BlockLoad) -> LoadResult:
        """Blocks from the offload daemon first, the rest from the remote engine."""
        remote = self._remote
        if remote is None:
            raise KVBridgeError("a load before register_kv_caches")
        if not load.offload_hashes or self.offload is None:
            return remote.load(load)
        if load.offload_groups:
            return self._load_groups(load)
        k = len(load.offload_hashes)
        local_self = list(load.local_ids[KVGroup.SELF])
        got = self.offload.load(local_self[:k], list(load.offload_hashes))  # never raises
        m = got.loaded
        if not load.remote_engine:  # nothing to fall back on: recompute what is missing
            return load_result(
                load,
                0.0,
                requested=k,
                bad=local_self[m:k],
                error=got.error if m < k else "",
                offloaded=m,
                elapsed_ms=got.elapsed_s * 1e3,
                offload_bad_digest=got.bad_digest,
            )
        return self._from_remote(skip_offloaded(load, m), got, m)

    def _from_remote(self, load: BlockLoad, got: OffloadLoadResult, n: int) -> LoadResult:
        """The rest of a load whose ``n`` other blocks came from the daemon (``got``): always
        to the peer, if only to release the lease on what it pinned for us."""
        assert self._remote is not None
        result = self._remote.load(load)
        return replace(
            result,
            blocks_requested=result.blocks_requested + n,
            transfer_ms=result.transfer_ms + got.elapsed_s * 1e3,
            blocks_offloaded=n,
            offload_bad_digest=got.bad_digest,
        )


def _log_steps(rid: RequestId, started: float, result: LoadResult) -> None:
    """One DEBUG line: how long each step of a load took, in ms, from ``start_load_kv``
    (``started``) to ``get_finished`` reporting it. ``start`` is the wait for a pool thread
    (0 when the engine's thread drove it), ``reported`` the wait for ``get_finished`` after
    the verdict."""
    now, last, parts = time.perf_counter(), started, []
    for step, at in result.steps:
        parts.append(f"{step} {(at - last) * 1e3:.3f}")
        last = max(last, at)
    parts.append(f"reported {(now - last) * 1e3:.3f}")
    steps_log.debug(
        "request %s: load steps (ms): %s; total %.3f (%s, path %s)",
        rid,
        ", ".join(parts),
        (now - started) * 1e3,
        "failed" if result.error else "ok",
        result.path or "-",
    )

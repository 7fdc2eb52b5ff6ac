"""Reading a remote engine's blocks: decode's load, fail closed, top to bottom.

One :class:`RemoteLoader` per engine process (owned by ``KVBridgeWorker``, called
from its load threads, or from the engine's own for a load whose links are made:
:mod:`~kvbridge.connector.load.inline`) keeps a control client and transport links per remote
engine (:mod:`~kvbridge.connector.load.links`). :meth:`RemoteLoader.load` is
the whole load: link, then the **sealed path** (READ the claimed ids, then the
lease's seal: no control RPC, the lease goes back by notification) or, without a
good seal, the **owner path** (the owner names the blocks for decode's own
names; the release answer confirms the lease never lapsed). The protocol and its
proof: :mod:`kvbridge.connector.control.seal` and docs/DESIGN-NOTES.md ("Trust").
READs land in the KV cache or, for a peer with another inner order
(``REARRANGE``), in a staging cache converted by :func:`kvbridge.kernels.convert_blocks`
(:mod:`~kvbridge.connector.load.reads`). ``self`` blocks not read whole are
reported bad; cross blocks are all or nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.seal_reader import SealReader
from kvbridge.connector.load.attempt import Attempt
from kvbridge.connector.load.inline import INLINE_LOADS, InlineLoad, start_inline
from kvbridge.connector.load.links import ClientFactory, LinkCache, Peer
from kvbridge.connector.load.owner import owner_blocks
from kvbridge.connector.load.ranks import load_from_ranks, ranks_failed, ranks_proven
from kvbridge.connector.load.reads import ReadFigures, ReadRequest, post_reads, read_groups
from kvbridge.connector.load.result import (
    link_suspect,
    load_result,
    timed_out,
    unverifiable,
    verdict,
)
from kvbridge.connector.load.sealed import load_sealed
from kvbridge.connector.load.verify import Checked, expect_from, fetch_from_ranks
from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import source_ranks
from kvbridge.proto.types import BlockId, LeaseId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.control.types import PeerInfo
    from kvbridge.connector.transport.base import LocalMemory, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["RELEASE_TIMEOUT_S", "RemoteLoader"]

log = logging.getLogger(__name__)
Advanced = LoadResult | Callable[[], LoadResult] | None  # RemoteLoader.advance's answer

RELEASE_TIMEOUT_S = 1.0
"""Deadline of one lease release (a release lost on the way lets the lease expire)."""


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
        self.memory = memory
        self.kv_caches = kv_caches
        self._seal_reader = SealReader(
            transport, config.max_concurrent_loads + INLINE_LOADS, config.load_timeout_s
        )
        self._links = LinkCache(
            transport,
            client_factory,
            local_info,
            memory,
            kv_caches,
            self._seal_reader,
            max_handshakes=config.max_concurrent_loads,
            handshake_wait_s=config.control_timeout_s + config.load_timeout_s,
            warm_timeout_s=config.load_timeout_s,
        )
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="kvb-release")
        """Releases after a failed load and disconnects run here, off the request's path."""
        self._hashers = ThreadPoolExecutor(1, thread_name_prefix="kvb-hash")
        """A thread that may hash a share of a load's blocks beside the checking thread."""

    def send_releases(self, *, loads_in_flight: bool = False) -> None:
        """Give back the leases of inline loads proven before (engine's thread, at the
        start of ``get_finished``): :meth:`SealReader.send_deferred`."""
        self._seal_reader.send_deferred(loads_in_flight=loads_in_flight)

    def close(self) -> None:
        """Drop every link and client and unregister the staging and scratch memory."""
        self.send_releases()  # best effort: one left unsent expires
        self._releases.shutdown(wait=True)  # each is short (RELEASE_TIMEOUT_S)
        self._hashers.shutdown(wait=True)
        self._links.close()
        self._seal_reader.close()

    def connect_ahead(self, loads: Sequence[BlockLoad]) -> None:
        """Start the handshake with each engine these loads name that is not linked yet, so
        the loads find it done or under way (called from the engine's step; never blocks)."""
        for load in loads:
            for rank in self._ranks(load):
                self._links.connect_ahead(load, rank)

    def connect_to(self, addresses: Sequence[str]) -> None:
        """Link now to the engines at ``addresses`` (rank-0 control addresses the operator
        allowed), each rank this worker will read from, so that not even the first load
        from them waits for a handshake; best effort, never blocks."""
        own = self.memory.layout
        for address in addresses:
            self._links.connect_address(
                address, lambda size: source_ranks(own.tp_rank, own.tp_size, size)
            )

    def _ranks(self, load: BlockLoad) -> list[int]:
        """The remote TP ranks holding this rank's heads (one unless the remote's TP size
        is a multiple of this engine's)."""
        own = self.memory.layout
        return source_ranks(own.tp_rank, own.tp_size, load.remote_tp_size)

    def _reader(self, load: BlockLoad) -> tuple[int, int]:
        """``(reader, readers)``: this rank among the ranks reading one remote rank."""
        own = self.memory.layout
        k = max(1, own.tp_size // load.remote_tp_size)
        return own.tp_rank % k, k

    def load(self, load: BlockLoad, *, retry_stale: bool = True) -> LoadResult:
        """Load ``load``'s blocks from its remote engine; never raises (fail closed). A load
        that failed through a cached link to an engine that has since restarted is retried
        once on the new process."""
        ranks = self._ranks(load)
        if len(ranks) > 1:  # heterogeneous TP: this rank's heads are on several ranks
            return load_from_ranks(
                load,
                ranks,
                self._links,
                self._seal_reader,
                self._read_unchecked,
                self.config.load_timeout_s,
                lambda engine, peer: self._forget(engine, peer, None),
                lambda peers: fetch_from_ranks(peers, load, self.config.control_timeout_s),
                self.memory.layout,
            )
        job = Attempt(load)
        return job.done(self._load(job, ranks[0], retry_stale))

    def start(self, load: BlockLoad) -> InlineLoad | None:
        """Post ``load``'s READs now, from the caller's (the engine's) thread, if it can go on
        without blocking (:func:`~kvbridge.connector.load.inline.start_inline`); then
        :meth:`advance` takes it on. None: not started, run :meth:`load` on a pool."""
        args = (self._links, self._seal_reader, self.memory.layout, self._hashers)
        return start_inline(load, self._ranks(load), *args, self.config, self.transport)

    def advance(self, inline: InlineLoad, spin_until: float = 0.0) -> Advanced:
        """Poll a load :meth:`start` started (never blocking; spinning until ``spin_until``):
        None while under way, else its result or, for a seal that did not hold or a failure,
        a call that finishes it on a pool (the owner path, the failure's handling)."""
        job, peers, load = inline.job, inline.peers, inline.job.load
        try:
            if not inline.poll(spin_until):
                return None
        except Exception as exc:
            inline.close()
            if len(peers) > 1:
                down = isinstance(exc, KVBridgeError) and link_suspect(exc)
                for peer in peers if down else []:  # a link may be down: handshake again
                    self._forget(load.remote_engine, peer, None)
                return job.done(ranks_failed(load, job.t0, str(exc) or repr(exc)))
            error = exc
            return lambda: job.done(self._failed(job, error, True))
        held, reads = inline.held, inline.reads
        assert held is not None and reads is not None
        for peer, ok in zip(peers, held, strict=True):
            if ok:  # proven ours: given back later (one whose seal did not hold expires)
                self._seal_reader.defer_release(peer.seal_link, load.lease_id, *self._reader(load))  # type: ignore[arg-type]
        if len(peers) > 1:
            ranks = self._ranks(load)
            checked = inline.checked if job.expected is not None else None
            return job.done(ranks_proven(load, job.t0, ranks, peers, held, reads, checked))
        if not held[0]:
            log.info("request %s: the seal does not hold; asking its owner", load.request_id)
            return lambda: job.done(self._owner_or_failed(job))
        assert inline.checked is not None
        done = {g: (read, inline.checked[g]) for g, read in zip(job.local, reads, strict=True)}
        return job.done(self._verdict(job, done, "sealed"))

    def _owner_or_failed(self, job: Attempt) -> LoadResult:
        try:
            peer, timeout = job.peer, self.config.control_timeout_s
            if job.expected is not None and job.expected.by_seal and peer is not None:
                args = (job.load, peer, self.memory.layout, self._hashers, timeout)
                job.expected = expect_from(job.expected, *args, ask=True)  # the owner's now
            return self._load_from_owner(job)
        except Exception as exc:
            return self._failed(job, exc, True)

    def _load(self, job: Attempt, rank: int, retry_stale: bool) -> LoadResult:
        load = job.load
        try:
            job.peer, job.cached = self._links.get(load, rank)
            job.link_ms = 0.0 if job.cached else (time.perf_counter() - job.t0) * 1e3
            job.mark("link")
            hashers, timeout = self._hashers, self.config.control_timeout_s
            args = (load, job.peer, self.memory.layout, hashers, timeout)
            if job.expected is not None:
                job.expected = expect_from(job.expected, *args)
                if job.expected is None:  # whole-block digests in the params: no slices
                    return unverifiable(load)
                job.mark("expect")
            if self.config.stall_before_read_s:
                time.sleep(self.config.stall_before_read_s)
            sealed = self._load_sealed(job)
            if sealed is not None:
                return sealed
            if job.expected is not None and job.expected.by_seal:  # the owner's digests now
                job.expected = expect_from(job.expected, *args, ask=True)
            return self._load_from_owner(job)
        except Exception as exc:
            return self._failed(job, exc, retry_stale)

    def _load_sealed(self, job: Attempt) -> LoadResult | None:
        """The sealed path on this thread (:func:`~kvbridge.connector.load.sealed.load_sealed`);
        None: the owner is asked."""
        return load_sealed(
            job,
            self._seal_reader,
            lambda wanted, check: self._read(job, wanted, check),
            self.memory.layout,
            self.config.load_timeout_s,
            self._reader(job.load),
            lambda done: self._verdict(job, done, "sealed"),
        )

    def _load_from_owner(self, job: Attempt) -> LoadResult:
        """The owner names the blocks (for decode's own names), they are READ, and the
        release answer confirms the lease held through the READ."""
        load, peer = job.load, job.peer
        assert peer is not None
        claimed = LeaseId(load.lease_id) if load.lease_id else None
        ttl = self.config.lease_ttl_s
        job.lease, remote = owner_blocks(peer, load, claimed, job.local, ttl)
        local_self, remote_self = job.local.get(KVGroup.SELF, []), remote.get(KVGroup.SELF, [])
        wanted: dict[KVGroup, tuple[list[BlockId], list[BlockId]]] = {}
        if n := len(remote_self):
            wanted[KVGroup.SELF] = (local_self[:n], remote_self[:n])
        # every other group (cross attention, a hybrid model's further ones): all or nothing
        whole = [g for g in job.local if g != KVGroup.SELF]
        gone = [g for g in whole if len(remote[g]) != len(job.local[g])]
        for g in [] if gone else whole:
            wanted[g] = (job.local[g], remote[g])
        done = self._read(job, wanted) if wanted else {}
        if not self._release(peer, job.lease):
            # the lease lapsed at some moment before the owner confirmed the read: the
            # blocks may have been reused under it. Recompute; never cache them.
            error = "lease lapsed during the read"
            log.warning("request %s: %s; recomputing", load.request_id, error)
            bad = local_self + job.local.get(KVGroup.CROSS, [])
            reads = [r for r, _ in done.values()]
            return load_result(load, job.t0, bad=bad, error=error, path="owner", reads=reads)
        if gone:  # all or nothing: the engine recomputes the whole request
            why = f"{gone[0]} blocks no longer held by the peer"
            return self._verdict(job, done, "owner", why)
        if n < len(local_self):
            return self._verdict(
                job, done, "owner", "lease gone (expired or released): partial prefix"
            )
        return self._verdict(job, done, "owner")

    def _verdict(
        self,
        job: Attempt,
        done: Mapping[KVGroup, tuple[ReadFigures, Checked]],
        path: str,
        error: str = "",
    ) -> LoadResult:
        """The result of a load whose READs ``done`` landed and were checked."""
        peer = job.peer
        return verdict(
            job.load,
            job.t0,
            job.local,
            done,
            path,
            error,
            address=peer.address if peer else job.load.remote_address,
            verified=job.expected is not None,
        )

    def _failed(self, job: Attempt, exc: Exception, retry_stale: bool) -> LoadResult:
        """A load that raised: retried once if its cached link was to a process since
        restarted; else the link is dropped, the lease given back, every block recomputed."""
        load, peer = job.load, job.peer
        if isinstance(exc, KVBridgeError):
            log.warning(
                "request %s: load from %s failed: %s", load.request_id, load.remote_engine, exc
            )
        else:  # a bug must still fail closed and give the pin back, not hang the request
            log.exception("request %s: unexpected load failure", load.request_id)
        if (
            peer is not None
            and job.cached
            and retry_stale
            and not timed_out(exc)  # a hung peer, not a restarted one
            and self._links.restarted(load, peer)
        ):
            # the link was to an earlier process of this engine: once more on the new one
            return self.load(load, retry_stale=False)
        if peer is not None and link_suspect(exc):
            self._forget(load.remote_engine, peer, job.lease)
        elif peer is not None:  # the owner refused over a working link: keep the link
            self._releases.submit(self._release, peer, job.lease)
        return load_result(
            load, job.t0, bad=job.local.get(KVGroup.SELF, []), error=str(exc) or repr(exc)
        )

    def _read(
        self,
        job: Attempt,
        groups: Mapping[KVGroup, tuple[list[BlockId], list[BlockId]]],
        check: bool = True,
    ) -> dict[KVGroup, tuple[ReadFigures, Checked]]:
        """READ each group's ``(local, remote)`` blocks, posted together (through the
        staging cache if the orders differ), checked against the load's digests before the
        engine may use the blocks (unless ``check`` is False: the caller then checks them
        with :meth:`_check`)."""
        assert job.peer is not None
        return read_groups(
            self.transport,
            job.peer,
            groups,
            self.config.load_timeout_s,
            self.memory,
            self.kv_caches,
            job.expected if check else None,
        )

    def _check(self, job: Attempt, group: KVGroup, local: list[BlockId]) -> Checked:
        """Check blocks READ straight into the KV cache against the load's digests."""
        if job.expected is None:
            return Checked(len(local), 0)
        return job.expected.check(self.memory.layout, group, local)

    def _read_unchecked(self, reads: Sequence[ReadRequest]) -> list[ReadFigures]:
        """READs across TP ranks (head slices), posted together; checked once every rank's
        slice landed."""
        return post_reads(self.transport, reads, self.config.load_timeout_s)

    def _release(self, peer: Peer, lease: LeaseId | None) -> bool:
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

    def _forget(self, engine: str, peer: Peer, lease: LeaseId | None) -> None:
        """Stop using ``peer`` for new loads; release ``lease`` (nothing was read under it)
        and disconnect, off the request's path."""
        self._links.forget(engine, peer)
        self._releases.submit(self._release_and_drop, peer, lease)

    def _release_and_drop(self, peer: Peer, lease: LeaseId | None) -> None:
        try:
            self._release(peer, lease)
        finally:
            self._links.drop(peer)

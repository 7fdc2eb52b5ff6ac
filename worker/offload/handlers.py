"""The offload daemon's ``OffloadStore`` logic over a NIXL-registered host pool.

Runs in the per-node offload daemon (``kvbridge offload serve``): :class:`OffloadHandlers`
does the work on protobuf messages and raises typed errors; :mod:`.server` is the gRPC shim.

The host memory is allocated and registered with NIXL **once**: at start if the config names
a layout, else at the first (authenticated) handshake, in that worker's layout (block-outermost
with its inner order unless configured otherwise), sized by ``capacity_bytes``. Later workers
must be compatible (``WHOLE_BLOCK`` or ``PER_SPAN``) or their handshake fails with the reason.
Only the ``self`` group is offloaded. Workers move the bytes with NIXL (WRITE into a prepared
store's slots, READ from a prepared load's); only ids and hashes cross gRPC. Stores and loads
belong to the session that made them; a store commits only after its writer's WRITE
notification arrived (:mod:`kvbridge.worker.offload.writers`).

CommitStore carries the writer's key, block digests and their algorithm; the pool keeps them
and PrepareLoad hands them to readers. Blocks a reader's CompleteLoad names as failing its
check are recomputed over the daemon's own memory (the writer's algorithm) and dropped only
if they really differ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.connector.control.types import (
    PeerInfo,
    Role,
    check_hash,
    check_lease_id,
    mode_to_pb,
    peer_from_pb,
    peer_to_pb,
)
from kvbridge.kernels import block_digests
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto.errors import (
    ConfigError,
    ControlPlaneError,
    IncompatibleLayoutError,
    LeaseError,
    WireError,
)
from kvbridge.proto.layout import KVLayout
from kvbridge.proto.negotiate import TransferMode, negotiate
from kvbridge.proto.types import BlockHash, BlockId, EngineId
from kvbridge.worker.offload.config import GROUP, OffloadConfig, pool_layout
from kvbridge.worker.offload.hugepages import allocate_pool
from kvbridge.worker.offload.pool import Digest, HostPool, OffloadStats, pool_key
from kvbridge.worker.offload.tiered import open_tiered, saved_layout
from kvbridge.worker.offload.writers import Sessions, check_agent_name, route_notifications

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.events import BlockEventSink
    from kvbridge.connector.transport.base import LocalMemory, Transport

__all__ = ["OffloadHandlers", "stats_to_pb"]

log = logging.getLogger(__name__)

NOTIFY_POLL_S = 0.0005
"""How often CommitStore looks for its WRITE notification while it waits (workers commit
while their last WRITEs still run, so a commit usually waits for one or two pieces)."""


@dataclass(slots=True)
class _Pool:
    info: PeerInfo
    memory: LocalMemory
    caches: dict[str, torch.Tensor]
    pool: HostPool


class OffloadHandlers:
    """``OffloadStore`` logic on protobuf messages; knows nothing of gRPC.

    Every method validates ids, counts and sizes first and changes no state
    when it raises. Thread-safe: the pool locks itself; setup holds a lock.
    """

    def __init__(
        self,
        transport: Transport,
        config: OffloadConfig,
        *,
        instance: str,
        events: Callable[[int], BlockEventSink] | None = None,
        disk_events: Callable[[int], BlockEventSink] | None = None,
    ) -> None:
        """``events(block_size)`` makes the pool's KV event sink when the pool is made
        (``disk_events`` the disk tier's, medium ``STORAGE``)."""
        self.transport = transport
        self._events = events
        self._disk_events = disk_events
        self.config = config
        self.instance = instance
        self._setup_lock = threading.Lock()
        self._state: _Pool | None = None
        self.sessions = Sessions(config.max_sessions, per_peer=config.max_sessions_per_peer)
        saved = None if config.disk_path is None else saved_layout(config.disk_path)
        if config.layout is not None or saved is not None:
            self._create(config.layout or saved)  # type: ignore[arg-type]

    @property
    def pool(self) -> HostPool | None:
        state = self._state
        return None if state is None else state.pool

    def caches(self) -> dict[str, torch.Tensor] | None:
        """The pool's tensors (tests inspect them); None before the first handshake."""
        state = self._state
        return None if state is None else state.caches

    def handshake(
        self, request: pb.OffloadHandshakeRequest, peer: str = ""
    ) -> pb.OffloadHandshakeResponse:
        """``peer`` is the caller's authenticated identity (``caller_identity``): the session
        opened is its, and every store and load made under it is charged to it."""
        if not request.HasField("peer"):
            raise WireError("handshake carries no peer info")
        remote = peer_from_pb(request.peer, self.config.limits)
        agent = check_agent_name(request.agent_name)
        with self._setup_lock:
            if self._state is None:
                self._create(remote.layout)
        state = self._ready()
        result = negotiate(state.info.layout, remote.layout)
        # HEAD_SLICE (another TP size) too: the daemon's blocks are whole pages of one size.
        # REARRANGE (another inner order) is the worker's business: it moves blocks through
        # a staging cache in the pool's order and converts them on its side.
        if result.mode in (TransferMode.INCOMPATIBLE, TransferMode.HEAD_SLICE):
            ours, theirs = state.info.layout, remote.layout
            raise IncompatibleLayoutError(
                f"worker {remote.engine_id} ({_describe(theirs)}) cannot use offload daemon "
                f"{state.info.engine_id} ({_describe(ours)}): {result.mode.value}: "
                f"{result.reason}"
            )
        session = self.sessions.open(agent, peer)
        log.info("handshake from %s (agent %s): %s", remote.engine_id, agent, result.mode.value)
        return pb.OffloadHandshakeResponse(
            peer=peer_to_pb(state.info),
            mode=mode_to_pb(result.mode),  # type: ignore[arg-type]
            mode_reason=result.reason,
            instance=self.instance,
            capacity_blocks=state.pool.num_blocks,
            session=session,
        )

    def lookup(self, request: pb.LookupRequest) -> pb.LookupResponse:
        state = self._ready()
        hashes = request.hashes
        self._keys(state, request.tp_rank, ())  # checks the rank
        self._check_hashes(hashes)
        prefix = pool_key(request.tp_rank, b"")
        # keys are built lazily: only the cached prefix and one miss are ever looked at
        keys = (BlockHash(prefix + h) for h in hashes)
        return pb.LookupResponse(num_hits=state.pool.lookup(keys, len(hashes)))

    def prepare_store(
        self, request: pb.PrepareStoreRequest, peer: str = ""
    ) -> pb.PrepareStoreResponse:
        state = self._ready()
        self._check_instance(request.instance)
        writer = self.sessions.agent(request.session, peer)
        keys = self._keys(state, request.tp_rank, request.hashes)
        ttl_s = self._ttl(request.ttl_ms)
        prepared = state.pool.prepare_store(keys, ttl_s, writer, peer)
        try:
            return pb.PrepareStoreResponse(
                store_id=prepared.store_id,
                indices=prepared.indices,
                slots=prepared.slots,
                evicted=prepared.evicted,
                expires_in_ms=_ms(prepared.expires_in_s),
            )
        except BaseException:
            # a reply that cannot be built must not leave the store held to its TTL
            state.pool.abort_store(prepared.store_id, writer, peer)
            raise

    def commit_store(
        self, request: pb.CommitStoreRequest, peer: str = ""
    ) -> pb.CommitStoreResponse:
        """Publish the caller's store once its WRITE notification arrived (waiting up to
        ``commit_wait_s`` for it); refuse another session's store or one nobody wrote."""
        state = self._ready()
        store_id = check_lease_id(request.store_id)
        writer = self.sessions.agent(request.session, peer)
        deadline = time.monotonic() + self.config.commit_wait_s
        digests = list(request.digests)
        while True:
            self._collect(state)
            try:
                n = state.pool.commit_store(
                    store_id, writer, request.digest_key, digests, request.digest_algo, peer
                )
                return pb.CommitStoreResponse(committed=n)
            except LeaseError as exc:
                if exc.code != "FAILED_PRECONDITION" or time.monotonic() >= deadline:
                    raise
            time.sleep(NOTIFY_POLL_S)

    def abort_store(self, request: pb.AbortStoreRequest, peer: str = "") -> pb.AbortStoreResponse:
        state = self._ready()
        store_id = check_lease_id(request.store_id)
        writer = self.sessions.agent(request.session, peer)
        return pb.AbortStoreResponse(aborted=state.pool.abort_store(store_id, writer, peer))

    def prepare_load(
        self, request: pb.PrepareLoadRequest, peer: str = ""
    ) -> pb.PrepareLoadResponse:
        state = self._ready()
        self._check_instance(request.instance)
        writer = self.sessions.agent(request.session, peer)
        keys = self._keys(state, request.tp_rank, request.hashes)
        ttl_s = self._ttl(request.ttl_ms)
        prepared = state.pool.prepare_load(keys, ttl_s, writer, peer)
        try:
            return pb.PrepareLoadResponse(
                load_id=prepared.load_id,
                slots=prepared.slots,
                expires_in_ms=_ms(prepared.expires_in_s),
                digest_keys=[k for k, _, _ in prepared.digests],
                digests=[d for _, d, _ in prepared.digests],
                digest_algos=[a for _, _, a in prepared.digests],
            )
        except BaseException:
            # a reply that cannot be built must not leave the blocks pinned to its TTL
            state.pool.complete_load(prepared.load_id, writer, peer)
            raise

    def complete_load(
        self, request: pb.CompleteLoadRequest, peer: str = ""
    ) -> pb.CompleteLoadResponse:
        state = self._ready()
        load_id = check_lease_id(request.load_id)
        writer = self.sessions.agent(request.session, peer)
        layout = state.memory.layout

        def confirm(slot: BlockId, digest: Digest) -> bool:
            key, want, algo = digest  # the writer's algorithm (a CPU reference if on a device)
            return block_digests(layout, GROUP, [slot], key, algo)[0] == want

        dropped = state.pool.drop_bad(load_id, writer, list(request.bad), confirm, peer)
        released = state.pool.complete_load(load_id, writer, peer)
        if request.bad:
            log.warning(
                "worker %s reported %d blocks of load %s failing their digest; %d confirmed "
                "and dropped",
                writer,
                len(request.bad),
                load_id,
                dropped,
            )
        return pb.CompleteLoadResponse(released=released, dropped=dropped)

    def stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        return stats_to_pb(self.snapshot(), self.instance)

    def snapshot(self) -> OffloadStats:
        """Current counters (all zero before the pool exists)."""
        state = self._state
        return OffloadStats() if state is None else state.pool.stats()

    def expire(self) -> int:
        """The reaper's tick: take in WRITE notifications, drop expired stores and loads."""
        state = self._state
        if state is None:
            return 0
        self._collect(state)
        return state.pool.expire()

    def close(self) -> None:
        """Drop pending stores/loads and unregister the pool (the transport stays open)."""
        with self._setup_lock:
            state, self._state = self._state, None
        if state is not None:
            state.pool.close()
            self.transport.unregister(state.memory)

    # ------------------------------------------------------------------ helpers

    def _create(self, template: KVLayout) -> None:
        layout = pool_layout(template, self.config)
        caches = allocate_pool(layout)  # on huge pages: a CMA transfer pins far fewer pages
        memory = self.transport.register(layout, caches)
        info = PeerInfo(
            engine_id=EngineId(self._agent_name()),
            role=Role.OFFLOAD,
            layout=memory.layout,
            agent_metadata=self.transport.metadata(),
        )
        num_blocks = layout.group(GROUP).num_blocks
        knobs = dict(
            max_pending=self.config.max_pending,
            max_stores_per_writer=self.config.max_stores_per_writer,
            max_pinned_per_writer=self.config.max_pinned_per_writer,
            events=None if self._events is None else self._events(layout.block_size),
            grace_s=self.config.expired_grace_s,
        )
        if self.config.disk_path is None:
            pool = HostPool(num_blocks, layout.block_bytes(GROUP), **knobs)  # type: ignore[arg-type]
        else:
            pool = open_tiered(memory.layout, self.config, knobs, self._disk_events)
        self._state = _Pool(info, memory, caches, pool)
        log.info(
            "offload pool: %d blocks of %d bytes (%s, %s)",
            pool.num_blocks,
            pool.block_bytes,
            layout.model.name,
            " ".join(layout.order),
        )

    def _agent_name(self) -> str:
        name = getattr(self.transport, "name", None)
        if not isinstance(name, str):
            raise ConfigError("the offload daemon's transport must have a NIXL agent name")
        return name

    def _collect(self, state: _Pool) -> None:
        route_notifications(self.transport.poll_notifications(), state.pool.mark_written)

    def _ready(self) -> _Pool:
        state = self._state
        if state is None:
            raise ControlPlaneError(
                "the offload pool does not exist yet: call Handshake first",
                code="FAILED_PRECONDITION",
            )
        return state

    def _check_instance(self, instance: str) -> None:
        if instance != self.instance:
            raise ControlPlaneError(
                f"this is offload daemon instance {self.instance}, not {instance[:64]!r} "
                "(it restarted): handshake again",
                code="FAILED_PRECONDITION",
            )

    def _keys(self, state: _Pool, tp_rank: int, hashes: Sequence[bytes]) -> list[BlockHash]:
        tp_size = state.info.layout.tp_size
        if not 0 <= tp_rank < tp_size:
            raise WireError(f"tp_rank {tp_rank} is outside the pool's tp_size {tp_size}")
        self._check_hashes(hashes)
        prefix = pool_key(tp_rank, b"")
        return [BlockHash(prefix + h) for h in hashes]

    def _check_hashes(self, hashes: Sequence[bytes]) -> None:
        limits = self.config.limits
        cap = limits.max_hashes_per_group
        if len(hashes) > cap:
            raise WireError(f"{len(hashes)} hashes exceed the {cap} accepted in one call")
        if hashes:
            lengths = set(map(len, hashes))
            if min(lengths) < limits.min_hash_bytes or max(lengths) > limits.max_hash_bytes:
                bad = next(
                    h
                    for h in hashes
                    if len(h) not in range(limits.min_hash_bytes, limits.max_hash_bytes + 1)
                )
                check_hash(bad, limits)  # raises WireError naming the size

    def _ttl(self, ttl_ms: int) -> float:
        """The TTL a request asks for, clamped to ``max_ttl_s`` in integers first (any uint64
        is fine)."""
        if ttl_ms == 0:
            return self.config.default_ttl_s
        return min(ttl_ms, round(self.config.max_ttl_s * 1000)) / 1000


_MAX_MS = 2**64 - 1


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds for a reply's uint64 field, whatever the figure."""
    return min(_MAX_MS, max(0, round(seconds * 1000)))


def _describe(layout: KVLayout) -> str:
    return (
        f"model {layout.model.name}, block_size {layout.block_size}, tp_size {layout.tp_size}, "
        f"order {' '.join(layout.order)}"
    )


def stats_to_pb(stats: OffloadStats, instance: str) -> pb.StatsResponse:
    fields = pb.StatsResponse.DESCRIPTOR.fields_by_name
    return pb.StatsResponse(
        instance=instance, **{k: getattr(stats, k) for k in OffloadStats.__slots__ if k in fields}
    )

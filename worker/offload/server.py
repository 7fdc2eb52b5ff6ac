"""The offload daemon's gRPC service: ``OffloadStore`` over a NIXL-registered host pool.

Runs in the per-node offload daemon (``kvbridge offload serve``). Laid out
like :mod:`kvbridge.connector.control.server`: :class:`OffloadHandlers` does the
work on protobuf messages and raises typed kvbridge errors; :class:`_Servicer`
is a thin shim that maps them to status codes with
:func:`kvbridge.connector.control.errors.status_for`; :func:`serve` builds and
starts an :class:`OffloadServer`.

The host memory is allocated and registered with NIXL **once**: at start if
the config names a layout, else at the first handshake, in the layout of that
worker (same model, block size and TP size; block-outermost with the worker's
inner order unless configured otherwise), sized by ``capacity_bytes``. Later
workers must be compatible with it (``WHOLE_BLOCK`` or ``PER_SPAN``) or their
handshake fails with the reason. Only the ``self`` group is offloaded.

Workers move the bytes with NIXL (WRITE into the slots of a prepared store,
READ from the slots of a prepared load); nothing but ids and hashes crosses
gRPC.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kvbridge.connector.control.errors import call_handler
from kvbridge.connector.control.grpc_server import ReapingServer
from kvbridge.connector.control.types import (
    ControlLimits,
    PeerInfo,
    Role,
    check_hash,
    check_lease_id,
    mode_to_pb,
    peer_from_pb,
    peer_to_pb,
)
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto import offload_pb2_grpc as pb_grpc
from kvbridge.proto.errors import (
    ConfigError,
    ControlPlaneError,
    IncompatibleLayoutError,
    WireError,
)
from kvbridge.proto.layout import KVLayout, parse_order
from kvbridge.proto.negotiate import TransferMode, negotiate
from kvbridge.proto.types import BlockHash, EngineId
from kvbridge.worker.offload.pool import HostPool, OffloadStats, pool_key

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import LocalMemory, Transport

__all__ = ["OffloadConfig", "OffloadHandlers", "OffloadServer", "serve", "stats_to_pb"]

log = logging.getLogger(__name__)

GROUP = "self"


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """The offload daemon's settings (built once at the edge: ``kvbridge offload serve``)."""

    capacity_bytes: int = 8 << 30
    host: str = "127.0.0.1"
    port: int = 0
    layout: KVLayout | None = None
    """Allocate the pool at start in this layout (block counts ignored); None: at 1st handshake."""
    order: tuple[str, ...] | None = None
    """Pool order; None: block-outermost with the (first) worker's inner order."""
    default_ttl_s: float = 30.0
    max_ttl_s: float = 300.0
    reap_interval_s: float = 0.5
    max_workers: int = 8
    max_pending: int = 4096
    limits: ControlLimits = field(default_factory=ControlLimits)

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1:
            raise ConfigError(f"capacity_bytes must be >= 1, got {self.capacity_bytes}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is outside 0..65535 (0 picks a free port)")
        if self.order is not None:
            parse_order(self.order)
        if not 0 < self.default_ttl_s <= self.max_ttl_s:
            raise ConfigError(
                f"need 0 < default_ttl_s ({self.default_ttl_s}) <= max_ttl_s ({self.max_ttl_s})"
            )
        if self.reap_interval_s <= 0:
            raise ConfigError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")
        if self.max_workers < 1 or self.max_pending < 1:
            raise ConfigError("max_workers and max_pending must be >= 1")


def pool_layout(template: KVLayout, config: OffloadConfig) -> KVLayout:
    """The daemon's pool layout for workers like ``template``, sized by the capacity."""
    order = config.order or ("B", "L", "KV", *template.inner_order)
    one = {g.name: 1 for g in template.groups}
    probe = replace(template, tp_rank=0, regions=(), _cache={}).with_order(order)
    probe = probe.with_num_blocks(**one)
    block_bytes = probe.block_bytes(GROUP)
    num_blocks = config.capacity_bytes // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"capacity of {config.capacity_bytes} bytes holds no {block_bytes}-byte block of "
            f"{template.model.name}; raise --capacity"
        )
    return probe.with_num_blocks(**{GROUP: num_blocks})


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

    def __init__(self, transport: Transport, config: OffloadConfig, *, instance: str) -> None:
        self.transport = transport
        self.config = config
        self.instance = instance
        self._setup_lock = threading.Lock()
        self._state: _Pool | None = None
        if config.layout is not None:
            self._create(config.layout)

    @property
    def pool(self) -> HostPool | None:
        state = self._state
        return None if state is None else state.pool

    def caches(self) -> dict[str, torch.Tensor] | None:
        """The pool's tensors (tests inspect them); None before the first handshake."""
        state = self._state
        return None if state is None else state.caches

    def handshake(self, request: pb.OffloadHandshakeRequest) -> pb.OffloadHandshakeResponse:
        if not request.HasField("peer"):
            raise WireError("handshake carries no peer info")
        remote = peer_from_pb(request.peer, self.config.limits)
        with self._setup_lock:
            if self._state is None:
                self._create(remote.layout)
        state = self._ready()
        result = negotiate(state.info.layout, remote.layout)
        if result.mode in (TransferMode.INCOMPATIBLE, TransferMode.REARRANGE):
            raise IncompatibleLayoutError(
                f"worker {remote.engine_id} cannot use offload daemon {state.info.engine_id}: "
                f"{result.mode.value}: {result.reason}"
            )
        log.info("handshake from %s: %s", remote.engine_id, result.mode.value)
        return pb.OffloadHandshakeResponse(
            peer=peer_to_pb(state.info),
            mode=mode_to_pb(result.mode),  # type: ignore[arg-type]
            mode_reason=result.reason,
            instance=self.instance,
            capacity_blocks=state.pool.num_blocks,
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

    def prepare_store(self, request: pb.PrepareStoreRequest) -> pb.PrepareStoreResponse:
        state = self._ready()
        self._check_instance(request.instance)
        keys = self._keys(state, request.tp_rank, request.hashes)
        ttl_s = self._ttl(request.ttl_ms)
        prepared = state.pool.prepare_store(keys, ttl_s)
        return pb.PrepareStoreResponse(
            store_id=prepared.store_id,
            indices=prepared.indices,
            slots=prepared.slots,
            evicted=prepared.evicted,
            expires_in_ms=round(prepared.expires_in_s * 1000),
        )

    def commit_store(self, request: pb.CommitStoreRequest) -> pb.CommitStoreResponse:
        state = self._ready()
        store_id = check_lease_id(request.store_id)
        return pb.CommitStoreResponse(committed=state.pool.commit_store(store_id))

    def abort_store(self, request: pb.AbortStoreRequest) -> pb.AbortStoreResponse:
        state = self._ready()
        store_id = check_lease_id(request.store_id)
        return pb.AbortStoreResponse(aborted=state.pool.abort_store(store_id))

    def prepare_load(self, request: pb.PrepareLoadRequest) -> pb.PrepareLoadResponse:
        state = self._ready()
        self._check_instance(request.instance)
        keys = self._keys(state, request.tp_rank, request.hashes)
        ttl_s = self._ttl(request.ttl_ms)
        prepared = state.pool.prepare_load(keys, ttl_s)
        return pb.PrepareLoadResponse(
            load_id=prepared.load_id,
            slots=prepared.slots,
            expires_in_ms=round(prepared.expires_in_s * 1000),
        )

    def complete_load(self, request: pb.CompleteLoadRequest) -> pb.CompleteLoadResponse:
        state = self._ready()
        load_id = check_lease_id(request.load_id)
        return pb.CompleteLoadResponse(released=state.pool.complete_load(load_id))

    def stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        return stats_to_pb(self.snapshot(), self.instance)

    def snapshot(self) -> OffloadStats:
        """Current counters (all zero before the pool exists)."""
        state = self._state
        return OffloadStats() if state is None else state.pool.stats()

    def expire(self) -> int:
        state = self._state
        return 0 if state is None else state.pool.expire()

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
        caches = layout.allocate()
        memory = self.transport.register(layout, caches)
        info = PeerInfo(
            engine_id=EngineId(self._agent_name()),
            role=Role.OFFLOAD,
            layout=memory.layout,
            agent_metadata=self.transport.metadata(),
        )
        pool = HostPool(
            layout.group(GROUP).num_blocks,
            layout.block_bytes(GROUP),
            max_pending=self.config.max_pending,
        )
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
        if ttl_ms == 0:
            return self.config.default_ttl_s
        return min(ttl_ms / 1000, self.config.max_ttl_s)


def stats_to_pb(stats: OffloadStats, instance: str) -> pb.StatsResponse:
    return pb.StatsResponse(
        instance=instance, **{k: getattr(stats, k) for k in OffloadStats.__slots__}
    )


class _Servicer(pb_grpc.OffloadStoreServicer):
    """Thin gRPC shim: call the handler, map a raised error to a status in one place."""

    def __init__(self, h: OffloadHandlers) -> None:
        self._h = h

    def Handshake(self, request: Any, context: Any) -> pb.OffloadHandshakeResponse:
        return call_handler(self._h.handshake, request, context)

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        return call_handler(self._h.lookup, request, context)

    def PrepareStore(self, request: Any, context: Any) -> pb.PrepareStoreResponse:
        return call_handler(self._h.prepare_store, request, context)

    def CommitStore(self, request: Any, context: Any) -> pb.CommitStoreResponse:
        return call_handler(self._h.commit_store, request, context)

    def AbortStore(self, request: Any, context: Any) -> pb.AbortStoreResponse:
        return call_handler(self._h.abort_store, request, context)

    def PrepareLoad(self, request: Any, context: Any) -> pb.PrepareLoadResponse:
        return call_handler(self._h.prepare_load, request, context)

    def CompleteLoad(self, request: Any, context: Any) -> pb.CompleteLoadResponse:
        return call_handler(self._h.complete_load, request, context)

    def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        return call_handler(self._h.stats, request, context)


class OffloadServer:
    """A running ``OffloadStore`` gRPC server plus the reaper that expires dead stores/loads."""

    def __init__(self, handlers: OffloadHandlers) -> None:
        self.handlers = handlers
        config = handlers.config
        self._grpc = ReapingServer(
            name="offload",
            host=config.host,
            port=config.port,
            max_workers=config.max_workers,
            max_message_bytes=config.limits.max_message_bytes,
            register=lambda server: pb_grpc.add_OffloadStoreServicer_to_server(
                _Servicer(handlers), server
            ),
            reap=handlers.expire,
            reap_interval_s=config.reap_interval_s,
        )
        self.port = self._grpc.port

    @property
    def address(self) -> str:
        return self._grpc.address

    def start(self) -> OffloadServer:
        self._grpc.start()
        log.info("offload daemon %s listening on %s", self.handlers.instance, self.address)
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._grpc.wait(timeout_s)

    def close(self, grace_s: float = 1.0) -> None:
        """Stop serving, stop the reaper, drop pending work and unregister the pool."""
        if self._grpc.close(grace_s):
            self.handlers.close()

    def __enter__(self) -> OffloadServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def new_instance() -> str:
    """A daemon instance id: 32 random lowercase hex digits, new on every start."""
    return secrets.token_hex(16)


def serve(
    transport: Transport, config: OffloadConfig | None = None, *, instance: str | None = None
) -> OffloadServer:
    """Start an offload daemon's service on ``transport`` (which the caller closes after)."""
    handlers = OffloadHandlers(
        transport, config or OffloadConfig(), instance=instance or new_instance()
    )
    return OffloadServer(handlers).start()

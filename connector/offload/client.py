"""A worker's client of the node's CPU offload daemon (``OffloadStore``).

Lives in the engine's worker process next to its :class:`Transport` and its
registered KV memory (both injected; the client owns neither). The connector
calls three methods, each blocking (run them off the engine's step thread or
in a job pool, like :mod:`kvbridge.connector.worker_side` does):

- :meth:`OffloadClient.lookup` — how many leading blocks of a prefix the daemon
  holds (committed blocks only);
- :meth:`OffloadClient.store` — PrepareStore (slots, evictions) → NIXL WRITE
  of local blocks into the slots → CommitStore; AbortStore on any failure;
- :meth:`OffloadClient.load` — PrepareLoad (pins the cached prefix) → NIXL
  READ into local blocks → CompleteLoad (unpins).

The data moves by NIXL only; gRPC carries ids and hashes. **Nothing raises into
the engine**: a missing, dead or restarted daemon is a cache miss (``lookup``
returns 0, ``store``/``load`` return a result with ``error`` set). After a
failure the client forgets its session and, after ``reconnect_backoff_s``,
handshakes again on next use. A load whose pin expired before CompleteLoad
reports 0 blocks loaded: the engine recomputes rather than decode from
blocks the daemon may have reused (fail closed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from kvbridge.connector.control.errors import error_from_rpc
from kvbridge.connector.control.types import (
    ControlLimits,
    PeerInfo,
    Role,
    mode_from_pb,
    peer_from_pb,
    peer_to_pb,
)
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto import offload_pb2_grpc as pb_grpc
from kvbridge.proto.errors import (
    ConfigError,
    ControlPlaneError,
    IncompatibleLayoutError,
    KVBridgeError,
    LeaseError,
    WireError,
)
from kvbridge.proto.negotiate import TransferMode, negotiate
from kvbridge.proto.types import BlockHash, BlockId, EngineId

if TYPE_CHECKING:
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport

__all__ = ["OffloadClient", "OffloadClientConfig", "OffloadStoreResult", "OffloadLoadResult"]

log = logging.getLogger(__name__)

GROUP = "self"


@dataclass(frozen=True, slots=True)
class OffloadClientConfig:
    """How a worker talks to its offload daemon (built once at the edge)."""

    address: str = "127.0.0.1:50060"
    engine_id: str = "kvbridge-worker"
    role: Role = Role.BOTH
    rpc_timeout_s: float = 2.0
    handshake_timeout_s: float = 60.0
    """The first handshake may wait while the daemon allocates and registers its pool."""
    transfer_timeout_s: float = 10.0
    ttl_s: float = 30.0
    """How long the daemon keeps a store's slots / a load's pins; > 2x transfer_timeout_s."""
    reconnect_backoff_s: float = 0.5
    limits: ControlLimits = field(default_factory=ControlLimits)

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError("OffloadClientConfig.address must be host:port of the daemon")
        for knob in ("rpc_timeout_s", "handshake_timeout_s", "transfer_timeout_s", "ttl_s"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"OffloadClientConfig.{knob} must be > 0")
        if self.ttl_s < 2 * self.transfer_timeout_s:
            raise ConfigError(
                f"OffloadClientConfig.ttl_s={self.ttl_s} must be >= 2 x transfer_timeout_s "
                f"({self.transfer_timeout_s}) so a slot never expires under a transfer"
            )
        if self.reconnect_backoff_s < 0:
            raise ConfigError("OffloadClientConfig.reconnect_backoff_s must be >= 0")


@dataclass(frozen=True, slots=True)
class OffloadStoreResult:
    """What one :meth:`OffloadClient.store` did.

    ``stored``: blocks written and committed; ``skipped``: blocks not written
    (already held, being written by another worker, or no room);
    ``evicted``: hashes the daemon dropped to make room. ``error`` is set when
    the store failed (then ``stored`` is 0 and nothing became visible).
    """

    stored: int = 0
    skipped: int = 0
    evicted: tuple[BlockHash, ...] = ()
    nbytes: int = 0
    elapsed_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class OffloadLoadResult:
    """What one :meth:`OffloadClient.load` did: ``block_ids[:loaded]`` now hold the blocks
    of ``hashes[:loaded]``; anything after is untouched or garbage (recompute it)."""

    loaded: int = 0
    nbytes: int = 0
    elapsed_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class _Session:
    instance: str
    daemon: PeerInfo
    link: PeerLink


class OffloadClient:
    """One worker's session with the node's offload daemon; thread-safe; close it."""

    def __init__(
        self, config: OffloadClientConfig, transport: Transport, local: LocalMemory
    ) -> None:
        self.config = config
        self._transport = transport
        self._local = local
        self._tp_rank = local.layout.tp_rank
        self._channel, self._stub = self._open_channel()
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._retry_at = 0.0
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._session is not None

    # ------------------------------------------------------------------ API

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the daemon holds; 0 on any failure (a miss)."""
        if not hashes:
            return 0
        try:
            self._connect()
            req = pb.LookupRequest(hashes=list(hashes), tp_rank=self._tp_rank)
            resp: pb.LookupResponse = self._call("Lookup", req)
            if resp.num_hits > len(hashes):
                raise WireError(f"Lookup answered {resp.num_hits} hits for {len(hashes)} hashes")
            return int(resp.num_hits)
        except Exception as exc:
            self._failed("lookup", exc)
            return 0

    def store(
        self, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> OffloadStoreResult:
        """Copy local ``block_ids`` (full blocks named ``hashes``) into the daemon.

        Only blocks the daemon lacks are written. Never raises (except for
        ``block_ids`` and ``hashes`` of different lengths, a caller bug).
        """
        _check_lengths(block_ids, hashes)
        if not hashes:
            return OffloadStoreResult()
        t0 = time.perf_counter()
        store_id = ""
        try:
            session = self._connect()
            req = pb.PrepareStoreRequest(
                instance=session.instance,
                tp_rank=self._tp_rank,
                hashes=list(hashes),
                ttl_ms=round(self.config.ttl_s * 1000),
            )
            resp: pb.PrepareStoreResponse = self._call("PrepareStore", req)
            store_id = resp.store_id
            evicted = tuple(BlockHash(bytes(h)) for h in resp.evicted)
            if not store_id:
                return OffloadStoreResult(
                    skipped=len(hashes), evicted=evicted, elapsed_s=time.perf_counter() - t0
                )
            indices, slots = self._checked_slots(session, resp.indices, resp.slots, len(hashes))
            local_ids = [block_ids[i] for i in indices]
            self._transfer("write", session, local_ids, slots)
            commit: pb.CommitStoreResponse = self._call(
                "CommitStore", pb.CommitStoreRequest(store_id=store_id)
            )
            store_id = ""
            nbytes = len(slots) * self._local.layout.block_bytes(GROUP)
            return OffloadStoreResult(
                stored=int(commit.committed),
                skipped=len(hashes) - int(commit.committed),
                evicted=evicted,
                nbytes=nbytes,
                elapsed_s=time.perf_counter() - t0,
            )
        except Exception as exc:
            if store_id:
                self._quietly("AbortStore", pb.AbortStoreRequest(store_id=store_id))
            self._failed("store", exc)
            return OffloadStoreResult(error=_describe(exc), elapsed_s=time.perf_counter() - t0)

    def load(self, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]) -> OffloadLoadResult:
        """Read the daemon's longest cached prefix of ``hashes`` into ``block_ids[:k]``.

        Returns ``loaded=k`` only when the READ finished while the daemon still
        held the pin; otherwise 0 (and ``error``). Never raises (except for a
        length mismatch, a caller bug).
        """
        _check_lengths(block_ids, hashes)
        if not hashes:
            return OffloadLoadResult()
        t0 = time.perf_counter()
        load_id = ""
        try:
            session = self._connect()
            req = pb.PrepareLoadRequest(
                instance=session.instance,
                tp_rank=self._tp_rank,
                hashes=list(hashes),
                ttl_ms=round(self.config.ttl_s * 1000),
            )
            resp: pb.PrepareLoadResponse = self._call("PrepareLoad", req)
            load_id = resp.load_id
            if not load_id:
                return OffloadLoadResult(elapsed_s=time.perf_counter() - t0)
            slots = list(resp.slots)
            if not 0 < len(slots) <= len(hashes):
                raise WireError(f"PrepareLoad pinned {len(slots)} blocks for {len(hashes)} hashes")
            session.daemon.layout.check_block_ids(GROUP, slots)
            self._transfer("read", session, list(block_ids[: len(slots)]), slots)
            done: pb.CompleteLoadResponse = self._call(
                "CompleteLoad", pb.CompleteLoadRequest(load_id=load_id)
            )
            load_id = ""
            if not done.released:
                raise LeaseError("the daemon dropped the load's pin before it completed")
            return OffloadLoadResult(
                loaded=len(slots),
                nbytes=len(slots) * self._local.layout.block_bytes(GROUP),
                elapsed_s=time.perf_counter() - t0,
            )
        except Exception as exc:
            if load_id:
                self._quietly("CompleteLoad", pb.CompleteLoadRequest(load_id=load_id))
            self._failed("load", exc)
            return OffloadLoadResult(error=_describe(exc), elapsed_s=time.perf_counter() - t0)

    def stats(self) -> dict[str, Any] | None:
        """The daemon's counters as a dict, or None if it cannot be reached."""
        try:
            resp: pb.StatsResponse = self._call("Stats", pb.StatsRequest())
        except KVBridgeError as exc:
            log.debug("offload stats: %s", exc)
            return None
        return {f.name: getattr(resp, f.name) for f in resp.DESCRIPTOR.fields}

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Drop the session (disconnect the link) and close the channel; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_session()
        self._channel.close()

    def __enter__(self) -> OffloadClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -------------------------------------------------------------- helpers

    def _open_channel(self) -> tuple[grpc.Channel, pb_grpc.OffloadStoreStub]:
        limits = self.config.limits
        channel = grpc.insecure_channel(
            self.config.address,
            options=[
                ("grpc.max_receive_message_length", limits.max_message_bytes),
                ("grpc.max_send_message_length", limits.max_message_bytes),
                ("grpc.enable_retries", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        return channel, pb_grpc.OffloadStoreStub(channel)

    def _connect(self) -> _Session:
        with self._lock:
            if self._closed:
                raise ControlPlaneError("the offload client is closed", code="CANCELLED")
            if self._session is not None:
                return self._session
            if time.monotonic() < self._retry_at:
                raise ControlPlaneError("offload daemon unreachable; retrying later", "UNAVAILABLE")
            if self._retry_at:
                # a fresh channel: the old one may sit in gRPC's reconnect backoff
                self._channel.close()
                self._channel, self._stub = self._open_channel()
                self._retry_at = 0.0
            local = PeerInfo(
                engine_id=EngineId(self.config.engine_id),
                role=self.config.role,
                layout=self._local.layout,
                agent_metadata=self._transport.metadata(),
            )
            req = pb.OffloadHandshakeRequest(peer=peer_to_pb(local))
            resp: pb.OffloadHandshakeResponse = self._call(
                "Handshake", req, self.config.handshake_timeout_s
            )
            daemon = peer_from_pb(resp.peer, self.config.limits)
            mode = mode_from_pb(resp.mode)
            ours = negotiate(self._local.layout, daemon.layout)
            if ours.mode is not mode or mode is TransferMode.REARRANGE:
                raise IncompatibleLayoutError(
                    f"offload daemon negotiated {mode.value}, we computed {ours.mode.value}"
                )
            if daemon.role is not Role.OFFLOAD or not resp.instance:
                raise WireError(f"{self.config.address} is not an offload daemon")
            link = self._transport.connect(
                daemon.engine_id, daemon.agent_metadata, daemon.layout, self._local
            )
            self._session = _Session(resp.instance, daemon, link)
            log.info(
                "offload daemon %s at %s: %s, %d blocks",
                resp.instance,
                self.config.address,
                mode.value,
                resp.capacity_blocks,
            )
            return self._session

    def _checked_slots(
        self, session: _Session, indices: Sequence[int], slots: Sequence[int], n: int
    ) -> tuple[list[int], list[int]]:
        if len(indices) != len(slots) or not slots:
            raise WireError(f"PrepareStore sent {len(indices)} indices and {len(slots)} slots")
        if any(not 0 <= i < n for i in indices) or len(set(indices)) != len(indices):
            raise WireError(f"PrepareStore indices are not distinct positions in 0..{n - 1}")
        if len(set(slots)) != len(slots):
            raise WireError("PrepareStore gave one slot twice")
        session.daemon.layout.check_block_ids(GROUP, slots)
        return list(indices), list(slots)

    def _transfer(
        self, op: str, session: _Session, local_ids: Sequence[int], slots: Sequence[int]
    ) -> None:
        post = self._transport.write_blocks if op == "write" else self._transport.read_blocks
        handle = post(
            session.link, GROUP, local_ids, slots, timeout_s=self.config.transfer_timeout_s
        )
        try:
            handle.wait()
        finally:
            handle.release()

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        fn = getattr(self._stub, method)
        try:
            return fn(request, timeout=timeout_s or self.config.rpc_timeout_s)
        except grpc.RpcError as err:
            raise error_from_rpc(f"{method} {self.config.address}", err) from None

    def _quietly(self, method: str, request: Any) -> None:
        try:
            self._call(method, request)
        except KVBridgeError as exc:
            log.debug("offload %s after a failure: %s", method, exc)

    def _failed(self, what: str, exc: Exception) -> None:
        """Log a failure; unless it was only a lost store/load, forget the session."""
        if isinstance(exc, LeaseError) and exc.code == "NOT_FOUND":
            log.info("offload %s: %s", what, exc)
            return
        level = logging.WARNING if self._session is not None else logging.DEBUG
        log.log(level, "offload %s failed (treated as a miss): %s", what, _describe(exc))
        with self._lock:
            self._drop_session()
            self._retry_at = time.monotonic() + self.config.reconnect_backoff_s

    def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                self._transport.disconnect(session.link)
            except Exception as exc:
                log.debug("disconnecting from the offload daemon: %r", exc)


def _check_lengths(block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
    if len(block_ids) != len(hashes):
        raise ConfigError(
            f"{len(block_ids)} block ids and {len(hashes)} hashes: they pair one to one"
        )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"

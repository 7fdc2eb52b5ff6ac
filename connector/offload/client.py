"""A worker's client of the node's CPU offload daemon (``OffloadStore``).

Lives in the engine's worker process next to its :class:`Transport` and its
registered KV memory (both injected; the client owns neither). The connector
calls three methods, each blocking (run them off the engine's step thread or
in a job pool, like :mod:`kvbridge.connector.worker_side` does):

- :meth:`OffloadClient.lookup` — how many leading blocks of a prefix the daemon
  holds (committed blocks only);
- :meth:`OffloadClient.store` — PrepareStore (slots, evictions; the leading blocks are
  digested while it is in flight) → NIXL WRITE
  of local blocks into the slots → CommitStore (posted once the blocks are digested, while
  the last WRITEs run: :mod:`kvbridge.connector.offload.commit`); AbortStore on any failure;
- :meth:`OffloadClient.load` — PrepareLoad (pins the cached prefix) → NIXL
  READ into local blocks → CompleteLoad (unpins).

The data moves by NIXL only; gRPC carries ids and hashes. Every call carries
the shared token (``token``) and the session id the handshake answered; the
WRITE of a store carries its notification, without which the daemon refuses
the commit. **A daemon that is unavailable is a cache miss, not an error**: a
missing, dead, restarted, refusing or misbehaving daemon (RPC, transport and
typed kvbridge errors) makes ``lookup`` return 0 and ``store``/``load``
return a result with ``error`` set, logged. Anything else (a bug: a
``TypeError``, an ``AttributeError``) propagates. After a failure the client
forgets its session and, after ``reconnect_backoff_s``, handshakes again on
next use. A load whose pin expired before CompleteLoad
reports 0 blocks loaded: the engine recomputes rather than decode from
blocks the daemon may have reused (fail closed).

**Integrity.** ``store`` sends the digests of the blocks it WRITEs (keyed per
store) in CommitStore; ``load`` gets them in PrepareLoad and, unless
``config.verify`` is off, checks every block after its READ
(:mod:`kvbridge.connector.offload.moves`): the first bad block and all after it
are not loaded (recomputed), and the bad ones are named in CompleteLoad.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from kvbridge.connector.control.errors import error_from_rpc
from kvbridge.connector.offload.commit import StoreCommit
from kvbridge.connector.offload.moves import BlockMover, load_digests
from kvbridge.connector.offload.session import (
    GROUP,
    Session,
    check_shared_pages,
    checked_slots,
    handshake,
)
from kvbridge.connector.offload.types import (
    OffloadClientConfig,
    OffloadLoadResult,
    OffloadStoreResult,
)
from kvbridge.connector.offload.wire import call_metadata, open_channel, store_notification
from kvbridge.kernels import new_key
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto import offload_pb2_grpc as pb_grpc
from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import (
    ConfigError,
    ControlPlaneError,
    KVBridgeError,
    LayoutError,
    LeaseError,
    PeerError,
    TransferError,
    WireError,
)
from kvbridge.proto.types import BlockHash, BlockId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import LocalMemory, Transport

__all__ = ["OffloadClient", "OffloadClientConfig", "OffloadStoreResult", "OffloadLoadResult"]

log = logging.getLogger(__name__)

UNAVAILABLE = (ControlPlaneError, TransferError, PeerError, WireError, LayoutError)
"""What a daemon that is down, restarted, refusing or misbehaving raises (RPC errors arrive
as ControlPlaneError): a miss. Other exceptions are bugs and propagate."""


class OffloadClient(Closing):
    """One worker's session with the node's offload daemon; thread-safe; close it."""

    def __init__(
        self,
        config: OffloadClientConfig,
        transport: Transport,
        local: LocalMemory,
        caches: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``caches``: the tensors of ``local``; with them a pool in another inner order
        (``REARRANGE``) is used through a staging cache, without them it is refused."""
        check_shared_pages(local.layout)
        self.config = config
        self._transport = transport
        self._local = local
        self._caches = caches
        self._mover = BlockMover(transport, local, caches, config.transfer_timeout_s)
        self._tp_rank = local.layout.tp_rank
        self._metadata = call_metadata(config.token)
        self._channel, self._stub = self._open_channel()
        self._lock = threading.Lock()
        self._session: Session | None = None
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
        except UNAVAILABLE as exc:
            self._failed("lookup", exc)
            return 0

    def store(
        self, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> OffloadStoreResult:
        """Copy local ``block_ids`` (full blocks named ``hashes``) into the daemon.

        Only blocks the daemon lacks are written. An unavailable daemon gives a
        result with ``error``; caller bugs (lengths that differ) and our own raise.
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
                session=session.session,
            )
            key = new_key()
            ask = self._stub.PrepareStore.future(
                req, timeout=self.config.rpc_timeout_s, metadata=self._metadata
            )
            known = self._mover.digest_while(session, block_ids, key, ask.done)
            try:
                resp: pb.PrepareStoreResponse = ask.result()
            except grpc.RpcError as err:
                raise error_from_rpc(f"PrepareStore {self.config.address}", err) from None
            store_id = resp.store_id
            evicted = tuple(BlockHash(bytes(h)) for h in resp.evicted)
            if not store_id:
                return OffloadStoreResult(
                    skipped=len(hashes), evicted=evicted, elapsed_s=time.perf_counter() - t0
                )
            indices, slots = checked_slots(session, resp.indices, resp.slots, len(hashes))
            local_ids = [block_ids[i] for i in indices]
            what = f"CommitStore {self.config.address}"
            early = StoreCommit(self._stub, self._call, what, self.config.rpc_timeout_s,
                                self._metadata, store_id, session.session, key)  # fmt: skip
            pre = [known[i] if i < len(known) else None for i in indices]
            try:  # the commit goes out with the last digests, while the last WRITEs run
                self._mover.write(session, local_ids, slots, store_notification(store_id),
                                  key, on_digests=early.send, known=pre)  # fmt: skip
            except BaseException:
                early.cancel()
                raise
            commit = early.result()
            store_id = ""
            nbytes = len(slots) * self._local.layout.block_bytes(GROUP)
            return OffloadStoreResult(
                stored=int(commit.committed),
                skipped=len(hashes) - int(commit.committed),
                evicted=evicted,
                nbytes=nbytes,
                elapsed_s=time.perf_counter() - t0,
            )
        except UNAVAILABLE as exc:
            if store_id:
                self._abort(store_id)
            self._failed("store", exc)
            return OffloadStoreResult(error=_describe(exc), elapsed_s=time.perf_counter() - t0)
        except BaseException:
            if store_id:
                self._abort(store_id)
            raise

    def load(self, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]) -> OffloadLoadResult:
        """Read the daemon's longest cached prefix of ``hashes`` into ``block_ids[:k]``.

        Returns ``loaded=k`` only when the READ finished while the daemon still
        held the pin; otherwise 0 (and ``error``). Caller bugs (a length
        mismatch) and our own raise.
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
                session=session.session,
            )
            resp: pb.PrepareLoadResponse = self._call("PrepareLoad", req)
            load_id = resp.load_id
            if not load_id:
                return OffloadLoadResult(elapsed_s=time.perf_counter() - t0)
            slots = list(resp.slots)
            if not 0 < len(slots) <= len(hashes):
                raise WireError(f"PrepareLoad pinned {len(slots)} blocks for {len(hashes)} hashes")
            session.daemon.layout.check_block_ids(GROUP, slots)
            digests = load_digests(resp, len(slots)) if self.config.verify else None
            local_ids = list(block_ids[: len(slots)])
            bad, verify_s = self._mover.read(session, local_ids, slots, digests)
            done: pb.CompleteLoadResponse = self._call(
                "CompleteLoad",
                pb.CompleteLoadRequest(load_id=load_id, session=session.session, bad=bad),
            )
            load_id = ""
            if not done.released:
                raise LeaseError("the daemon dropped the load's pin before it completed")
            good = bad[0] if bad else len(slots)
            if bad:
                log.warning(
                    "offload daemon %s: %d of %d loaded blocks failed their digest check "
                    "(first at position %d; the daemon confirmed and dropped %d): "
                    "recomputing from there",
                    self.config.address,
                    len(bad),
                    len(slots),
                    good,
                    done.dropped,
                )
            return OffloadLoadResult(
                loaded=good,
                nbytes=good * self._local.layout.block_bytes(GROUP),
                elapsed_s=time.perf_counter() - t0,
                bad_digest=len(bad),
                verify_s=verify_s,
                error=f"{len(bad)} blocks failed their digest check" if bad else "",
            )
        except UNAVAILABLE as exc:
            if load_id:
                self._complete_quietly(load_id)
            self._failed("load", exc)
            return OffloadLoadResult(error=_describe(exc), elapsed_s=time.perf_counter() - t0)
        except BaseException:
            if load_id:
                self._complete_quietly(load_id)
            raise

    def stats(self) -> dict[str, Any] | None:
        """The daemon's counters as a dict, or None if it cannot be reached."""
        try:
            resp: pb.StatsResponse = self._call("Stats", pb.StatsRequest())
        except UNAVAILABLE as exc:
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
        self._mover.close()
        self._channel.close()

    # -------------------------------------------------------------- helpers

    def _open_channel(self) -> tuple[grpc.Channel, pb_grpc.OffloadStoreStub]:
        limits = self.config.limits
        channel = open_channel(
            self.config.address,
            [
                ("grpc.max_receive_message_length", limits.max_message_bytes),
                ("grpc.max_send_message_length", limits.max_message_bytes),
                ("grpc.enable_retries", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
            root_cert=self.config.root_cert,
            server_name=self.config.server_name,
        )
        return channel, pb_grpc.OffloadStoreStub(channel)

    def _connect(self) -> Session:
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
            self._session = handshake(
                self._call, self.config, self._transport, self._local, self._caches
            )
            return self._session

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        fn = getattr(self._stub, method)
        try:
            return fn(
                request, timeout=timeout_s or self.config.rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise error_from_rpc(f"{method} {self.config.address}", err) from None

    def _abort(self, store_id: str) -> None:
        session = self._session
        if session is not None:
            req = pb.AbortStoreRequest(store_id=store_id, session=session.session)
            self._quietly("AbortStore", req)

    def _complete_quietly(self, load_id: str) -> None:
        session = self._session
        if session is not None:
            req = pb.CompleteLoadRequest(load_id=load_id, session=session.session)
            self._quietly("CompleteLoad", req)

    def _quietly(self, method: str, request: Any) -> None:
        try:
            self._call(method, request)
        except KVBridgeError as exc:
            log.debug("offload %s after a failure: %s", method, exc)

    def _failed(self, what: str, exc: Exception) -> None:
        """Log a failure; unless it was only a lost store/load or a full quota, forget the
        session."""
        if (isinstance(exc, LeaseError) and exc.code == "NOT_FOUND") or (
            isinstance(exc, ControlPlaneError) and exc.code == "RESOURCE_EXHAUSTED"
        ):
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
            if session.staging is not None:
                with session.staging.lock:  # no transfer of another thread still uses it
                    self._transport.unregister(session.staging.memory)


def _check_lengths(block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]) -> None:
    if len(block_ids) != len(hashes):
        raise ConfigError(
            f"{len(block_ids)} block ids and {len(hashes)} hashes: they pair one to one"
        )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"

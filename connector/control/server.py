"""The peer control server: handshake, pins under leases, heartbeats, health.

Every kvbridge process that owns KV memory runs one. The layout is the one in
gRPC's ``route_guide``: :class:`ControlHandlers` does the work on protobuf
messages and raises typed kvbridge errors; :class:`_Servicer` is a thin shim
that maps those errors to status codes (via :mod:`kvbridge.connector.control.errors`);
:func:`serve` builds and starts a :class:`ControlServer`. Optional shared-token
auth is a server interceptor (:mod:`kvbridge.connector.control.auth`), so a peer
without the token learns nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvbridge.connector.control.auth import accepted_tokens, caller_identity
from kvbridge.connector.control.bounds import WaitSlots
from kvbridge.connector.control.errors import call_handler, lease_not_found
from kvbridge.connector.control.grpc_server import ReapingServer, ServedByReaping
from kvbridge.connector.control.leases import BlockOwner, Claimant, Lease, LeaseTable, PeerCaps
from kvbridge.connector.control.server_config import ControlServerConfig
from kvbridge.connector.control.types import (
    PeerInfo,
    check_hashes,
    check_lease_id,
    check_request_id,
    mode_to_pb,
    peer_from_pb,
    peer_to_pb,
    role_to_pb,
)
from kvbridge.proto import control_pb2 as pb
from kvbridge.proto import control_pb2_grpc as pb_grpc
from kvbridge.proto.errors import (
    BlockPoolError,
    ControlPlaneError,
    IncompatibleLayoutError,
    WireError,
)
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import Negotiation, TransferMode, negotiate
from kvbridge.proto.types import BlockHash, BlockId
from kvbridge.proto.version import PROTOCOL_VERSION

__all__ = [
    "DIGESTS_WAIT_S",
    "ControlServerConfig",
    "HandshakeHook",
    "ControlHandlers",
    "ControlServer",
    "serve",
]

log = logging.getLogger(__name__)

_MAX_MS = (1 << 63) - 1
"""Millisecond figures in replies stay below this (the fields are uint64)."""

DIGESTS_WAIT_S = 0.5
"""How long a Digests call waits for an owner that has made the lease but not yet recorded
its digests (after that: NOT_FOUND, and the reader recomputes). Calls over the wait caps are
answered RESOURCE_EXHAUSTED (busy) and asked again by the client within its deadline."""

HandshakeHook = Callable[[PeerInfo, Negotiation], None]
"""Called after a compatible handshake with the caller's info, e.g. to add it as a NIXL peer.
It runs on a server thread; raising a kvbridge error fails the handshake with that error."""


class ControlHandlers:
    """The control service's logic on protobuf messages; knows nothing of gRPC.

    Each method validates every id, count and size first and changes no
    state when it raises.
    """

    def __init__(
        self,
        local: PeerInfo,
        leases: LeaseTable,
        config: ControlServerConfig,
        on_handshake: HandshakeHook | None = None,
    ) -> None:
        self.local = local
        self.leases = leases
        self.config = config
        self._on_handshake = on_handshake
        self._groups = tuple(g.name for g in local.layout.groups)
        self._local_pb = peer_to_pb(local)
        waits = config.max_digest_waits or max(1, config.max_workers // 2)
        self.digest_waits = WaitSlots(waits, config.max_digest_waits_per_peer)
        """Bounds the ``Digests`` calls that park a server thread (see :meth:`digests`)."""

    @property
    def owner(self) -> BlockOwner:
        return self.leases.owner

    def handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeResponse:
        if not request.HasField("peer"):
            raise WireError("handshake carries no peer info")
        remote = peer_from_pb(request.peer, self.config.limits)
        result = negotiate(self.local.layout, remote.layout)
        if result.mode is TransferMode.INCOMPATIBLE:
            raise IncompatibleLayoutError(
                f"peer {remote.engine_id} cannot exchange blocks with {self.local.engine_id}: "
                f"{result.reason}"
            )
        if self._on_handshake is not None:
            self._on_handshake(remote, result)
        log.info(
            "handshake from %s (%s): %s", remote.engine_id, remote.role.value, result.mode.value
        )
        return pb.HandshakeResponse(
            peer=self._local_pb,
            mode=mode_to_pb(result.mode),  # type: ignore[arg-type]
            mode_reason=result.reason,
        )

    def pin(self, request: pb.PinRequest, peer: str = "") -> pb.PinResponse:
        """``peer`` is the caller's identity: new leases count against its caps, and an
        owner-made hand-over it pins by request id becomes its own."""
        ttl_s = self._ttl(request.ttl_ms)
        target = request.WhichOneof("target")
        if target == "request_id":
            return pb.PinResponse(lease=self._pin_request(request.request_id, ttl_s, peer))
        if target == "hashes":
            return pb.PinResponse(lease=self._pin_hashes(request.hashes, ttl_s, peer))
        raise WireError("pin names neither a request id nor block hashes")

    def heartbeat(self, request: pb.HeartbeatRequest, peer: str = "") -> pb.HeartbeatResponse:
        """Extends only the caller's own leases (``peer``); others' are not answered alive."""
        limit = self.config.limits.max_lease_ids_per_heartbeat
        if len(request.lease_ids) > limit:
            raise WireError(f"heartbeat of {len(request.lease_ids)} leases exceeds {limit}")
        ids = [check_lease_id(x) for x in request.lease_ids]
        ttl_s = self._ttl(request.ttl_ms)
        alive = self.leases.heartbeat(ids, ttl_s, self._claimant(peer))
        now = self.leases.now()
        # the soonest expiry among them: a lifetime cap may stop one short of the TTL asked
        soonest = min((lease.expires_at - now for lease in alive), default=ttl_s)
        return pb.HeartbeatResponse(
            alive=[lease.lease_id for lease in alive], expires_in_ms=_ms(soonest)
        )

    def release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        lease_id = check_lease_id(request.lease_id)
        return pb.ReleaseResponse(released=self.leases.release(lease_id))

    def digests(self, request: pb.DigestsRequest, peer: str = "") -> pb.DigestsResponse:
        """The digests recorded for a hand-over lease. Not secret: without the lease's key
        (only in kv_transfer_params) no one can make other bytes match them. An owner that
        digests after making the lease (vLLM's worker) is waited for up to
        ``DIGESTS_WAIT_S``, but only by a bounded number of calls at once, in all and per
        caller ``peer`` (:class:`WaitSlots`): a call over the caps answers at once, so
        asking for unknown leases cannot hold the server's threads. Over the caps, a lease
        not made yet is answered ``RESOURCE_EXHAUSTED`` (busy: its digests may be coming,
        the client asks again within its deadline); a lease made without digests, or one
        waited for in vain, ``NOT_FOUND``."""
        lease_id = check_lease_id(request.lease_id)
        got = self.leases.digests(lease_id)
        if got is None:
            with self.digest_waits.slot(peer) as may_wait:
                if may_wait:
                    got = self.leases.digests(lease_id, wait_s=DIGESTS_WAIT_S)
                elif self.leases.get(lease_id) is None:
                    raise ControlPlaneError(
                        f"busy: lease {lease_id} is not made yet and the Digests wait slots are "
                        f"full ({self.digest_waits.total} in all, {self.digest_waits.per_peer} "
                        "per caller); ask again",
                        code="RESOURCE_EXHAUSTED",
                    )
                else:  # made since the first look: its digests are recorded with it
                    got = self.leases.digests(lease_id)
        if got is None:
            raise lease_not_found(f"no digests recorded for lease {lease_id}")
        return pb.DigestsResponse(
            algo=got.algo,
            groups=[pb.GroupHashes(group=g, hashes=list(d)) for g, d in got.groups.items()],
            heads=got.heads,
            head_groups=[
                pb.GroupHashes(group=g, hashes=list(d)) for g, d in got.head_groups.items()
            ],
        )

    def health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        self.leases.expire()
        return pb.HealthResponse(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self.local.engine_id,
            role=role_to_pb(self.local.role),  # type: ignore[arg-type]
            num_leases=len(self.leases),
        )

    # ------------------------------------------------------------------ helpers

    def _ttl(self, ttl_ms: int) -> float:
        """The TTL a request asks for, clamped to ``max_ttl_s`` (any uint64 is fine)."""
        if ttl_ms == 0:
            return self.config.default_ttl_s
        return min(ttl_ms, self.config.max_ttl_s * 1000) / 1000

    def _claimant(self, peer: str) -> Claimant:
        lifetime = self.config.max_lease_lifetime_s or self.config.max_ttl_s
        return Claimant(peer, self._peer_caps(), lifetime)

    def _pin_request(self, request_id: str, ttl_s: float, peer: str) -> pb.Lease:
        rid = check_request_id(request_id, self.config.limits)
        lease = self.leases.get_by_request(rid)
        alive = []
        if lease is not None:
            alive = self.leases.heartbeat([lease.lease_id], ttl_s, self._claimant(peer), claim=True)
        if not alive:
            raise lease_not_found(
                f"no lease for request {rid!r} that this peer may pin: it was never pinned "
                "here, was released, expired, or another peer holds it; recompute its KV"
            )
        return self._lease_pb(alive[0])

    def _pin_hashes(self, msg: pb.PinByHashes, ttl_s: float, peer: str) -> pb.Lease:
        limits = self.config.limits
        wanted: dict[KVGroup, list[BlockHash]] = {}
        for item in msg.groups:
            if item.group not in self._groups:
                raise WireError(f"unknown group {item.group[:64]!r}; this peer has {self._groups}")
            group = KVGroup(item.group)
            if group in wanted:
                raise WireError(f"group {group!r} appears twice")
            cap = min(limits.max_hashes_per_group, self.owner.num_blocks(group))
            if len(item.hashes) > cap:
                raise WireError(
                    f"{len(item.hashes)} hashes for group {group!r} exceed the "
                    f"{cap} blocks this peer can hold"
                )
            wanted[group] = check_hashes(item.hashes, limits)
        if not any(wanted.values()):
            return pb.Lease()
        if not self.leases.has_room():
            raise self._table_full()
        pinned = self.owner.pin_hashes(wanted)
        try:
            blocks = self._check_pinned(wanted, pinned)
            if not any(blocks.values()):
                return pb.Lease()
            hashes = {g: wanted[g][: len(ids)] for g, ids in blocks.items()}
            lease = self.leases.create(
                blocks, ttl_s=ttl_s, hashes=hashes, peer=peer, caps=self._peer_caps()
            )
        except BaseException:
            self.owner.unpin(pinned)
            raise
        try:
            return self._lease_pb(lease)
        except BaseException:  # the peer never learns the id: nobody could release it
            self.leases.release(lease.lease_id)
            raise

    def _peer_caps(self) -> PeerCaps:
        max_blocks = self.config.max_blocks_per_peer
        if max_blocks is None:
            max_blocks = max(1, sum(self.owner.num_blocks(g) for g in self._groups) // 2)
        return PeerCaps(self.config.max_leases_per_peer, max_blocks)

    def _check_pinned(
        self, wanted: dict[KVGroup, list[BlockHash]], pinned: dict[KVGroup, list[BlockId]]
    ) -> dict[KVGroup, list[BlockId]]:
        """The owner's answer, checked against what was asked before any id goes on the wire.

        A bad answer is an owner bug, but these ids leave the process and a peer READs
        them, so the check is an error (``python -O`` keeps it), not an assert:
        :class:`BlockPoolError` answers the peer ``INTERNAL`` and the caller unpins.
        """
        extra = set(pinned) - set(wanted)
        if extra:
            raise BlockPoolError(f"owner pinned groups {sorted(extra)} that were not asked for")
        for group, ids in pinned.items():
            n = self.owner.num_blocks(group)
            if len(ids) > len(wanted[group]):
                raise BlockPoolError(
                    f"owner pinned {len(ids)} {group!r} blocks for {len(wanted[group])} hashes"
                )
            for b in ids:
                if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
                    raise BlockPoolError(
                        f"owner returned {group!r} block id {b!r} outside 0..{n - 1}"
                    )
        return {g: ids for g, ids in pinned.items() if ids}

    def _lease_pb(self, lease: Lease) -> pb.Lease:
        remaining = max(0.0, lease.expires_at - self.leases.now())
        return pb.Lease(
            lease_id=lease.lease_id,
            expires_in_ms=_ms(remaining),
            request_id=lease.request_id or "",
            blocks=[pb.GroupBlocks(group=g, block_ids=ids) for g, ids in lease.blocks.items()],
            hashes=[pb.GroupHashes(group=g, hashes=h) for g, h in lease.hashes.items()],
        )

    def _table_full(self) -> Exception:
        return ControlPlaneError(
            f"{len(self.leases)} leases are held; the table is full", code="RESOURCE_EXHAUSTED"
        )


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds for a reply's uint64 field, whatever the figure."""
    return min(_MAX_MS, max(0, round(seconds * 1000)))


class _Servicer(pb_grpc.PeerControlServicer):
    """Thin gRPC shim: call the handler, map a raised error to a status in one place."""

    def __init__(self, handlers: ControlHandlers) -> None:
        self._h = handlers
        self._tokens = accepted_tokens(handlers.config.listen.token)

    def _caller(self, context: Any) -> str:
        return caller_identity(context, self._tokens)

    def Handshake(self, request: pb.HandshakeRequest, context: Any) -> pb.HandshakeResponse:
        return call_handler(self._h.handshake, request, context)

    def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        return call_handler(lambda r: self._h.pin(r, self._caller(context)), request, context)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        return call_handler(lambda r: self._h.heartbeat(r, self._caller(context)), request, context)

    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return call_handler(self._h.release, request, context)

    def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        return call_handler(self._h.health, request, context)

    def Digests(self, request: pb.DigestsRequest, context: Any) -> pb.DigestsResponse:
        return call_handler(lambda r: self._h.digests(r, self._caller(context)), request, context)


class ControlServer(ServedByReaping):
    """A gRPC server for one :class:`ControlHandlers`, plus its lease reaper.

    Construction binds the port (so :attr:`address` is known before the handlers
    exist: an engine puts it into the configs it builds next); :meth:`start` adds the
    handlers and serves. ``close()`` stops accepting calls, stops the reaper and
    releases every lease (their blocks become evictable). Use it as a context manager.
    """

    def __init__(self, config: ControlServerConfig) -> None:
        self.config = config
        self._handlers: ControlHandlers | None = None
        self._grpc = ReapingServer.for_config(
            "control",
            config,
            register=lambda server: pb_grpc.add_PeerControlServicer_to_server(
                _Servicer(self.handlers), server
            ),
            reap=lambda: self.leases.expire(),
        )

    @property
    def handlers(self) -> ControlHandlers:
        assert self._handlers is not None, "a bound control server that was never started"
        return self._handlers

    @property
    def leases(self) -> LeaseTable:
        return self.handlers.leases

    def start(self, handlers: ControlHandlers) -> ControlServer:
        """Serve ``handlers`` (built with this server's config) on the bound port."""
        assert self._handlers is None, "a control server starts once"
        self._handlers = handlers
        self._grpc.start()
        log.info("control server for %s listening on %s", handlers.local.engine_id, self.address)
        return self

    def close(self, grace_s: float = 1.0) -> None:
        if not self._grpc.close(grace_s) or self._handlers is None:
            return
        released = self.leases.release_all()
        if released:
            log.info("control server closed; released %d lease(s)", released)


def serve(
    local: PeerInfo,
    owner: BlockOwner | LeaseTable,
    config: ControlServerConfig | None = None,
    on_handshake: HandshakeHook | None = None,
) -> ControlServer:
    """Start a control server for ``local``; pass a :class:`LeaseTable` to share it with the
    owner (which creates leases for finished requests), or just the owner."""
    config = config or ControlServerConfig()
    leases = owner if isinstance(owner, LeaseTable) else LeaseTable(owner)
    return ControlServer(config).start(ControlHandlers(local, leases, config, on_handshake))

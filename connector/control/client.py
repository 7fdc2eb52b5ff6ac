"""A typed client of a peer's control service (``PeerControl``).

Every call has a deadline. Only idempotent calls (``Health``, ``Heartbeat``,
``Release``) are retried, and only on ``UNAVAILABLE``, within the call's
deadline. Failures come back as typed kvbridge errors (see
:mod:`control_errors`). After :meth:`ControlClient.handshake`, block ids in
``Pin`` answers are bounds-checked against the peer's layout before anyone can
hand them to NIXL.

This module imports gRPC; :mod:`kvbridge.connector` imports it only when a
client is wanted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kvbridge.connector.control.errors import TOKEN_KEY, error_from_rpc
from kvbridge.connector.control.leases import HandOverDigests
from kvbridge.connector.control.types import (
    ControlLimits,
    HealthInfo,
    PeerInfo,
    PinnedBlocks,
    check_lease_id,
    mode_from_pb,
    peer_from_pb,
    peer_to_pb,
    role_from_pb,
)
from kvbridge.kernels.digest import DIGEST_BYTES
from kvbridge.proto import control_pb2 as pb
from kvbridge.proto import control_pb2_grpc as pb_grpc
from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import ConfigError, ControlPlaneError, WireError
from kvbridge.proto.layout import KVGroup, parse_group
from kvbridge.proto.negotiate import Negotiation, negotiate
from kvbridge.proto.types import BlockHash, BlockId, EngineId, LeaseId, RequestId

__all__ = [
    "BUSY_BACKOFF_MAX_S",
    "BUSY_BACKOFF_S",
    "ControlClient",
    "DigestsCall",
    "HandshakeResult",
]

Resp = TypeVar("Resp")

BUSY_BACKOFF_S = 0.002
"""First pause before a ``Digests`` call answered busy (RESOURCE_EXHAUSTED) is asked again."""
BUSY_BACKOFF_MAX_S = 0.05
"""The pauses double up to this; the retries stop at the call's deadline."""


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    """The peer's identity, layout and agent metadata, and how we move blocks with it."""

    peer: PeerInfo
    negotiation: Negotiation


class ControlClient(Closing):
    """One channel to one peer's control service; close it (or use ``with``)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        root_cert: bytes | None = None,
        server_name: str | None = None,
        timeout_s: float = 5.0,
        retries: int = 2,
        retry_backoff_s: float = 0.05,
        limits: ControlLimits | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}")
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.limits = limits or ControlLimits()
        self.peer: PeerInfo | None = None
        """The peer's info once :meth:`handshake` succeeded."""
        self._metadata: tuple[tuple[str, str], ...] = () if token is None else ((TOKEN_KEY, token),)
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.limits.max_message_bytes),
            ("grpc.max_send_message_length", self.limits.max_message_bytes),
            ("grpc.enable_retries", 0),  # retries are ours, and only where idempotent
        ]
        if server_name is not None:
            options.append(("grpc.ssl_target_name_override", server_name))
        if root_cert is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_cert)
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.PeerControlStub(self._channel)
        self._closed = False

    # ----------------------------------------------------------------- calls

    def handshake(self, local: PeerInfo, *, timeout_s: float | None = None) -> HandshakeResult:
        """Exchange identities and layouts; raises IncompatibleLayoutError or
        VersionMismatchError (peer said FAILED_PRECONDITION) with the peer's reason."""
        req = pb.HandshakeRequest(peer=peer_to_pb(local))
        resp: pb.HandshakeResponse = self._call("Handshake", req, timeout_s, retry=False)
        try:
            peer = peer_from_pb(resp.peer, self.limits)
            mode = mode_from_pb(resp.mode)
        except WireError as exc:
            raise WireError(f"Handshake answer from {self.address}: {exc}") from None
        ours = negotiate(local.layout, peer.layout)
        if ours.mode is not mode:
            raise WireError(
                f"peer {peer.engine_id} negotiated {mode.value}, we computed {ours.mode.value}"
            )
        self.peer = peer
        return HandshakeResult(peer, ours)

    def pin_request(
        self, request_id: RequestId, *, ttl_s: float | None = None, timeout_s: float | None = None
    ) -> PinnedBlocks:
        """The lease the peer created when ``request_id`` finished, extended by ``ttl_s``.

        Raises :class:`LeaseError` (code ``NOT_FOUND``) if it is gone: recompute.
        """
        req = pb.PinRequest(request_id=request_id, ttl_ms=_ttl_ms(ttl_s))
        resp: pb.PinResponse = self._call("Pin", req, timeout_s, retry=False)
        return self._pinned(resp.lease, None)

    def pin_hashes(
        self,
        group_hashes: Mapping[KVGroup, Sequence[BlockHash]],
        *,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> PinnedBlocks:
        """Pin the longest prefix of each group's hashes the peer still holds, under a new lease.

        The answer may be shorter than asked (blocks were evicted), or empty
        with ``lease_id=None`` (nothing to read, nothing to release).
        """
        req = pb.PinRequest(
            hashes=pb.PinByHashes(
                groups=[pb.GroupHashes(group=g, hashes=list(h)) for g, h in group_hashes.items()]
            ),
            ttl_ms=_ttl_ms(ttl_s),
        )
        resp: pb.PinResponse = self._call("Pin", req, timeout_s, retry=False)
        return self._pinned(resp.lease, group_hashes)

    def heartbeat(
        self,
        lease_ids: Sequence[LeaseId],
        *,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> frozenset[LeaseId]:
        """Extend leases; returns those still alive (a missing one expired: recompute)."""
        req = pb.HeartbeatRequest(lease_ids=list(lease_ids), ttl_ms=_ttl_ms(ttl_s))
        resp: pb.HeartbeatResponse = self._call("Heartbeat", req, timeout_s, retry=True)
        alive = frozenset(LeaseId(x) for x in resp.alive)
        if not alive <= set(lease_ids):
            raise WireError(f"Heartbeat answer from {self.address} names leases we did not send")
        return alive

    def release(self, lease_id: LeaseId, *, timeout_s: float | None = None) -> bool:
        """Unpin a lease; False if the peer no longer held it (expired or already released)."""
        req = pb.ReleaseRequest(lease_id=lease_id)
        resp: pb.ReleaseResponse = self._call("Release", req, timeout_s, retry=True)
        return bool(resp.released)

    def digests(
        self, lease_id: LeaseId, *, timeout_s: float | None = None, busy_retry: bool = True
    ) -> HandOverDigests:
        """The block digests the owner recorded for hand-over lease ``lease_id``; LeaseError
        (NOT_FOUND) if it recorded none. A busy owner (``RESOURCE_EXHAUSTED``: its wait
        slots are full) is asked again after a short backoff until the deadline, unless
        ``busy_retry`` is False."""
        req = pb.DigestsRequest(lease_id=lease_id)
        resp = self._call("Digests", req, timeout_s, retry=True, busy_retry=busy_retry)
        return self._digests_from(resp)

    def digests_call(self, lease_id: LeaseId, *, timeout_s: float | None = None) -> DigestsCall:
        """:meth:`digests`, sent now without waiting: gRPC's own thread takes the answer, no
        thread of ours runs the call (:class:`DigestsCall`: ``done`` never blocks)."""
        if self._closed:
            raise ControlPlaneError("Digests: the client is closed", code="CANCELLED")
        timeout = timeout_s or self.timeout_s
        req = pb.DigestsRequest(lease_id=lease_id)
        call = self._stub.Digests.future(req, timeout=timeout, metadata=self._metadata)
        return DigestsCall(self, lease_id, call, time.monotonic() + timeout)

    def _digests_from(self, resp: pb.DigestsResponse) -> HandOverDigests:
        groups = _digest_groups(resp.groups)
        heads = _digest_groups(resp.head_groups)
        for g, d in heads.items():
            if len(d) != resp.heads * len(groups.get(g, ())):
                raise WireError(
                    f"digests reply: {len(d)} head digests of group {g!r} are not "
                    f"{resp.heads} per block"
                )
        return HandOverDigests(resp.algo, groups, resp.heads if heads else 0, heads)

    def health(self, *, timeout_s: float | None = None) -> HealthInfo:
        resp: pb.HealthResponse = self._call("Health", pb.HealthRequest(), timeout_s, retry=True)
        return HealthInfo(
            engine_id=EngineId(resp.engine_id),
            role=role_from_pb(resp.role),
            protocol_version=resp.protocol_version,
            num_leases=resp.num_leases,
        )

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()

    # ---------------------------------------------------------------- helpers

    def _call(
        self,
        method: str,
        request: Any,
        timeout_s: float | None,
        *,
        retry: bool,
        busy_retry: bool = False,
    ) -> Any:
        """One call within its deadline; ``retry``: again on UNAVAILABLE (``retries``
        times); ``busy_retry``: again on RESOURCE_EXHAUSTED as often as the deadline
        allows, after :data:`BUSY_BACKOFF_S` doubling up to :data:`BUSY_BACKOFF_MAX_S`."""
        if self._closed:
            raise ControlPlaneError(f"{method}: the client is closed", code="CANCELLED")
        fn: Callable[..., Any] = getattr(self._stub, method)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        attempt = 0
        busy = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                return fn(request, timeout=max(remaining, 0.001), metadata=self._metadata)
            except grpc.RpcError as err:
                if busy_retry and err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    pause = min(BUSY_BACKOFF_S * 2**busy, BUSY_BACKOFF_MAX_S)
                    if time.monotonic() + pause < deadline:
                        busy += 1
                        time.sleep(pause)
                        continue
                backoff = self.retry_backoff_s * 2**attempt
                if (
                    retry
                    and attempt < self.retries
                    and err.code() is grpc.StatusCode.UNAVAILABLE
                    and time.monotonic() + backoff < deadline
                ):
                    attempt += 1
                    time.sleep(backoff)
                    continue
                raise error_from_rpc(f"{method} {self.address}", err) from None

    def _pinned(
        self, msg: pb.Lease, asked: Mapping[KVGroup, Sequence[BlockHash]] | None
    ) -> PinnedBlocks:
        """Check a Pin answer against what we asked and the peer's layout."""
        where = f"Pin answer from {self.address}"
        if not msg.lease_id:
            if msg.blocks:
                raise WireError(f"{where}: blocks without a lease")
            return PinnedBlocks(lease_id=None, expires_in_s=0.0)
        lease_id = check_lease_id(msg.lease_id)
        blocks: dict[KVGroup, tuple[BlockId, ...]] = {}
        for item in msg.blocks:
            group = parse_group(item.group, WireError)
            if group in blocks:
                raise WireError(f"{where}: group {group!r} repeats")
            ids = tuple(BlockId(b) for b in item.block_ids)
            if asked is not None and len(ids) > len(asked.get(group, ())):
                raise WireError(f"{where}: more blocks than hashes for group {group!r}")
            if self.peer is not None and ids:
                n = self.peer.layout.group(group).num_blocks  # LayoutError if unknown
                if max(ids) >= n:
                    raise WireError(f"{where}: block id {max(ids)} is outside 0..{n - 1}")
            blocks[group] = ids
        hashes = {
            parse_group(item.group, WireError): tuple(BlockHash(h) for h in item.hashes)
            for item in msg.hashes
        }
        if asked is not None:
            for group, ids in blocks.items():
                if hashes.get(group, ()) != tuple(asked[group][: len(ids)]):
                    raise WireError(f"{where}: hashes of group {group!r} are not our prefix")
        rid = msg.request_id
        return PinnedBlocks(
            lease_id=lease_id,
            expires_in_s=msg.expires_in_ms / 1000,
            blocks=blocks,
            hashes=hashes,
            request_id=RequestId(rid) if rid else None,
        )


_U64_MAX = (1 << 64) - 1


def _ttl_ms(ttl_s: float | None) -> int:
    if ttl_s is None:
        return 0
    if not ttl_s > 0:  # NaN too
        raise ConfigError(f"ttl_s must be > 0, got {ttl_s}")
    # the field is a uint64 and the server clamps to its maximum anyway: ask for at most that
    return max(1, min(_U64_MAX, round(ttl_s * 1000) if math.isfinite(ttl_s) else _U64_MAX))


def _digest_groups(got: Iterable[pb.GroupHashes]) -> dict[KVGroup, tuple[bytes, ...]]:
    groups: dict[KVGroup, tuple[bytes, ...]] = {}
    for g in got:
        group = parse_group(g.group, WireError)
        if group in groups or any(len(d) != DIGEST_BYTES for d in g.hashes):
            raise WireError(f"digests reply: bad or repeated group {group!r}")
        groups[group] = tuple(bytes(d) for d in g.hashes)
    return groups


class DigestsCall:
    """A Digests RPC in flight (:meth:`ControlClient.digests_call`). ``result`` waits for
    it; one that failed as ``UNAVAILABLE`` or busy (``RESOURCE_EXHAUSTED``) is asked again
    as :meth:`ControlClient.digests` asks (retried) within the same deadline."""

    def __init__(
        self, client: ControlClient, lease_id: LeaseId, call: Any, deadline: float
    ) -> None:
        self._client = client
        self._lease = lease_id
        self._call = call
        self._deadline = deadline

    def done(self) -> bool:
        return bool(self._call.done())

    def result(self, timeout: float | None = None) -> HandOverDigests:
        left = self._deadline - time.monotonic()
        try:
            resp = self._call.result(timeout=left if timeout is None else min(timeout, left))
        except grpc.RpcError as err:
            busy = err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            left = self._deadline - time.monotonic() - (BUSY_BACKOFF_S if busy else 0.0)
            if (busy or err.code() is grpc.StatusCode.UNAVAILABLE) and left > 0:
                if busy:  # the owner's wait slots are full: ask again shortly
                    time.sleep(BUSY_BACKOFF_S)
                return self._client.digests(self._lease, timeout_s=left)
            raise error_from_rpc(f"Digests {self._client.address}", err) from None
        except grpc.FutureCancelledError:
            raise ControlPlaneError(
                f"Digests {self._client.address}: cancelled (the client closed)", code="CANCELLED"
            ) from None
        except grpc.FutureTimeoutError:
            raise ControlPlaneError(
                f"Digests {self._client.address}: no answer before the deadline",
                code="DEADLINE_EXCEEDED",
            ) from None
        return self._client._digests_from(resp)

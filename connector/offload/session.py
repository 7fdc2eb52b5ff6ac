"""A worker's session with its offload daemon: the handshake and what it proves.

Used by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process). The handshake sends our layout, NIXL metadata and agent name; the
daemon answers its own, its instance id and our session id. We check the
answer (it is an offload daemon, we agree on the transfer mode) and link our
transport to its pool. A worker whose inner order differs from the pool's
(``REARRANGE``) links through a staging cache in the pool's order
(:mod:`kvbridge.connector.offload.staging`) when it was given its KV tensors.
Slots the daemon hands out later are checked against its layout here before
they can reach NIXL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.connector.control.types import (
    PeerInfo,
    Role,
    mode_from_pb,
    peer_from_pb,
    peer_to_pb,
)
from kvbridge.connector.offload.staging import Staging
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto.errors import IncompatibleLayoutError, WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode, negotiate
from kvbridge.proto.types import EngineId

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from kvbridge.connector.offload.types import OffloadClientConfig
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport

__all__ = ["GROUP", "Session", "checked_slots", "handshake"]

log = logging.getLogger(__name__)

GROUP = KVGroup.SELF
"""The only group the daemon holds."""

Call = Callable[[str, Any, float | None], Any]


@dataclass(frozen=True, slots=True)
class Session:
    instance: str
    """The daemon's instance id (new on every daemon start)."""
    session: str
    """Our session id: every store and load call carries it."""
    daemon: PeerInfo
    link: PeerLink
    staging: Staging | None = None
    """REARRANGE: the cache in the pool's order that blocks move through."""


def handshake(
    call: Call,
    config: OffloadClientConfig,
    transport: Transport,
    local: LocalMemory,
    caches: Mapping[str, torch.Tensor] | None = None,
) -> Session:
    """Handshake through ``call`` (the client's RPC), check the answer, link to the pool
    (through a staging cache if the orders differ and ``caches``, our KV, is given)."""
    info = PeerInfo(
        engine_id=EngineId(config.engine_id),
        role=config.role,
        layout=local.layout,
        agent_metadata=transport.metadata(),
    )
    agent = getattr(transport, "name", None)
    req = pb.OffloadHandshakeRequest(
        peer=peer_to_pb(info), agent_name=agent if isinstance(agent, str) else config.engine_id
    )
    resp: pb.OffloadHandshakeResponse = call("Handshake", req, config.handshake_timeout_s)
    daemon = peer_from_pb(resp.peer, config.limits)
    mode = mode_from_pb(resp.mode)
    ours = negotiate(local.layout, daemon.layout)
    rearrange = mode is TransferMode.REARRANGE and caches is not None
    if (
        ours.mode is not mode
        or mode is TransferMode.HEAD_SLICE
        or (mode is TransferMode.REARRANGE and not rearrange)
    ):
        raise IncompatibleLayoutError(
            f"offload daemon negotiated {mode.value}, we computed {ours.mode.value}"
        )
    if daemon.role is not Role.OFFLOAD or not resp.instance or not resp.session:
        raise WireError(f"{config.address} is not an offload daemon")
    staging = None
    target = local
    if rearrange:
        assert caches is not None
        staging = Staging.create(transport, local.layout, caches, daemon.layout, GROUP)
        target = staging.memory
    try:
        link = transport.connect(daemon.engine_id, daemon.agent_metadata, daemon.layout, target)
    except BaseException:
        if staging is not None:
            transport.unregister(staging.memory)
        raise
    log.info(
        "offload daemon %s at %s: %s, %d blocks",
        resp.instance,
        config.address,
        mode.value,
        resp.capacity_blocks,
    )
    return Session(resp.instance, resp.session, daemon, link, staging)


def checked_slots(
    session: Session, indices: Sequence[int], slots: Sequence[int], n: int
) -> tuple[list[int], list[int]]:
    """PrepareStore's ``(indices, slots)`` for ``n`` hashes, checked before any WRITE."""
    if len(indices) != len(slots) or not slots:
        raise WireError(f"PrepareStore sent {len(indices)} indices and {len(slots)} slots")
    if any(not 0 <= i < n for i in indices) or len(set(indices)) != len(indices):
        raise WireError(f"PrepareStore indices are not distinct positions in 0..{n - 1}")
    if len(set(slots)) != len(slots):
        raise WireError("PrepareStore gave one slot twice")
    session.daemon.layout.check_block_ids(GROUP, slots)
    return list(indices), list(slots)

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
from kvbridge.proto.errors import ConfigError, IncompatibleLayoutError, WireError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.negotiate import TransferMode, negotiate
from kvbridge.proto.specs import is_attention_group
from kvbridge.proto.types import EngineId

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from kvbridge.connector.offload.types import OffloadClientConfig
    from kvbridge.connector.transport.base import LocalMemory, PeerLink, Transport

__all__ = ["GROUP", "Session", "check_shared_pages", "checked_slots", "handshake"]

log = logging.getLogger(__name__)

GROUP = KVGroup.SELF
"""The group whose pages the daemon holds: a hybrid model's other attention groups are
stored as ``self``-shaped pages too (:func:`check_shared_pages`)."""

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
    if rearrange and not local.layout.uniform_pages:
        # the staging cache converts every group's blocks as self-shaped pages: right for
        # groups of self's page shape only
        shaped = [str(g.name) for g in local.layout.groups if g.page is not None]
        raise IncompatibleLayoutError(
            f"offload daemon {config.address} keeps the pool in order "
            f"{' '.join(daemon.layout.order)}, ours is {' '.join(local.layout.order)}, and "
            f"kvbridge does not yet convert groups of their own page shape ({shaped}) between "
            "orders; start the daemon with this worker's order (--order)"
        )
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


def check_shared_pages(layout: KVLayout) -> None:
    """ConfigError unless every attention group (``g<i>``) of ``layout`` sees the very pages
    of ``self``: the same regions and block count, pages of the same bytes at the same
    places (vLLM's hybrid KV cache groups with equal page sizes: tensor ``i`` holds layer
    ``i`` of every group, each group viewing the page in its own shape). Then a group's
    block ``b`` is the bytes of ``self``'s block ``b``, and the offload daemon's
    ``self``-sized slots hold every group's blocks, each under its group's name. A page of
    other bytes (vLLM's padded pages) is refused by name."""
    if not layout.regions:
        return  # not bound to memory: nothing to move yet

    def pages(group: KVGroup) -> list[tuple[int, int, str]]:
        return sorted(
            (r.addr, r.length, r.device)
            for r in map(layout.regions.__getitem__, layout.regions_of(group))
        )

    def places(group: KVGroup) -> tuple[int, ...]:
        """Where a block's spans lie (the outer strides) and how long they are."""
        st = layout.strides(group)
        return (st["B"], st["L"], st["KV"], layout.group_span_bytes(group))

    mine = pages(GROUP)
    for g in layout.groups:
        if not is_attention_group(g.name):
            continue
        theirs = pages(g.name)
        if layout.block_bytes(g.name) != layout.block_bytes(GROUP):
            raise ConfigError(
                f"offload_address: KV cache group {g.name!r} has blocks of "
                f"{layout.block_bytes(g.name)} bytes, group 'self' of "
                f"{layout.block_bytes(GROUP)}, and the offload daemon keeps one block size; "
                "run without offload_address"
            )
        if (
            theirs != mine
            or g.num_blocks != layout.group(GROUP).num_blocks
            or places(g.name) != places(GROUP)
        ):
            raise ConfigError(
                f"offload_address: KV cache group {g.name!r} does not share the pages of "
                f"group 'self' ({len(theirs)} regions, {g.num_blocks} blocks; 'self': "
                f"{len(mine)}, {layout.group(GROUP).num_blocks}), and the offload daemon "
                "keeps self-shaped pages only; run without offload_address, or start vLLM "
                "with --disable-hybrid-kv-cache-manager"
            )


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

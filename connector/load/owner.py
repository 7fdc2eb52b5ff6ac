"""The slow path's first step: the owner of the blocks names which ids to read.

Used by :class:`~kvbridge.connector.load.RemoteLoader` when a load has no lease
seal that holds (see docs/DESIGN-NOTES.md, "Trust: owner-proven loads").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbridge.proto.errors import LeaseError, WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId, LeaseId, RequestId

if TYPE_CHECKING:
    from kvbridge.connector.base import BlockLoad
    from kvbridge.connector.load.links import Peer

__all__ = ["owner_blocks"]

log = logging.getLogger(__name__)


def owner_blocks(
    peer: Peer,
    load: BlockLoad,
    lease: LeaseId | None,
    local: Mapping[KVGroup, list[BlockId]],
    ttl: float,
) -> tuple[LeaseId | None, dict[KVGroup, list[BlockId]]]:
    """The remote ids to read, as the blocks' owner names them: ``(lease, ids per group)``.

    Block ids in ``kv_transfer_params`` are a router's claim and never read.
    The owner answers with its lease for the request (extending it), and its
    names for those blocks must be exactly the names this engine computed
    from its own prompt. If the lease is gone, the longest prefix the owner
    still holds under those names is pinned anew (the rest is recomputed).
    """
    groups = list(local)
    pinned = None
    if lease is not None and load.remote_request_id:
        try:
            pinned = peer.client.pin_request(RequestId(load.remote_request_id), ttl_s=ttl)
        except LeaseError:
            log.info("request %s: the owner's lease is gone", load.request_id)
    if pinned is not None and pinned.lease_id is not None:
        remote: dict[KVGroup, list[BlockId]] = {}
        for g in groups:
            first = load.lease_offset(g)
            want = tuple(load.remote_hashes.get(g, ()))
            names = tuple(pinned.hashes.get(g, ()))[first : first + len(want)]
            ids = list(pinned.blocks.get(g, ()))[first : first + len(local[g])]
            if names != want or len(ids) != len(local[g]):
                # not released: the lease belongs to whichever request the params named
                raise WireError(
                    f"the owner's lease for request {load.remote_request_id!r} holds other "
                    f"{g!r} blocks than this prompt's (forged or mismatched params)"
                )
            remote[g] = ids
        return pinned.lease_id, remote
    # no lease (expired, released, or never made): pin what is still there by name
    hashes = {g: list(load.remote_hashes.get(g, ())) for g in groups}
    again = peer.client.pin_hashes(hashes, ttl_s=ttl)
    remote = {g: list(again.blocks.get(g, ())) for g in groups}
    log.info(
        "request %s: lease gone; %s blocks still pinned",
        load.request_id,
        {g: f"{len(remote[g])}/{len(local[g])}" for g in groups},
    )
    return again.lease_id, remote

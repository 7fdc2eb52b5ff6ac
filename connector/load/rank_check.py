"""The TP rank check of a handshake: the peer must hold the KV heads this worker reads.

Used by :mod:`kvbridge.connector.load.links` when a handshake answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.proto.errors import PeerError
from kvbridge.proto.negotiate import source_ranks

if TYPE_CHECKING:
    from kvbridge.connector.base import BlockLoad
    from kvbridge.proto.layout import KVLayout

__all__ = ["check_rank"]


def check_rank(local: KVLayout, remote: KVLayout, address: str, load: BlockLoad, rank: int) -> None:
    """The peer must be TP rank ``rank`` of the TP size the load names, and ``rank`` one
    this worker reads from (:func:`source_ranks`): any other rank holds other KV heads
    (wrong tokens), so the load fails closed."""
    want = source_ranks(local.tp_rank, local.tp_size, load.remote_tp_size)
    if (remote.tp_size, remote.tp_rank) != (load.remote_tp_size, rank) or rank not in want:
        raise PeerError(
            f"{address} is TP rank {remote.tp_rank} of {remote.tp_size}; this worker (TP rank "
            f"{local.tp_rank} of {local.tp_size}) reads rank(s) {want} of "
            f"{load.remote_tp_size}: its blocks hold other KV heads; not reading from it"
        )

"""The data plane: the :class:`Transport` seam and its NIXL implementation.

A transport moves whole blocks between registered memories (READ and WRITE by
block id, with notifications); it knows nothing about hashes, leases or
eviction. :class:`NixlTransport` implements it. NIXL itself loads on first use.
"""

from kvbridge.connector.transport.base import (
    LinkDownError,
    LocalMemory,
    PeerLink,
    TransferHandle,
    TransferOp,
    TransferState,
    Transport,
)
from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport

__all__ = [
    "LinkDownError",
    "LocalMemory",
    "NixlConfig",
    "NixlTransport",
    "PeerLink",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "Transport",
]

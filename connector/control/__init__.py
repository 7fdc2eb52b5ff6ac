"""The peer control plane: a prefill's leases over its blocks, served over gRPC.

The server (:class:`ControlServer`) runs wherever an engine owns blocks that peers
read: kvbridge's serving node and vLLM's worker process alike. The client
(:class:`ControlClient`) runs in the reading engine. The wire types and leases
load without grpc; the client and server load it on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbridge.connector.control.leases import BlockOwner, Lease, LeaseTable
from kvbridge.connector.control.types import (
    ControlLimits,
    HealthInfo,
    PeerInfo,
    PinnedBlocks,
    Role,
)

if TYPE_CHECKING:
    from kvbridge.connector.control.client import ControlClient, HandshakeResult
    from kvbridge.connector.control.server import ControlServer, ControlServerConfig, serve

__all__ = [
    "BlockOwner",
    "ControlClient",
    "ControlLimits",
    "ControlServer",
    "ControlServerConfig",
    "HandshakeResult",
    "HealthInfo",
    "Lease",
    "LeaseTable",
    "PeerInfo",
    "PinnedBlocks",
    "Role",
    "serve",
]

_LAZY = {
    "ControlClient": "client",
    "HandshakeResult": "client",
    "ControlServer": "server",
    "ControlServerConfig": "server",
    "serve": "server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

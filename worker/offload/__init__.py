"""The per-node CPU offload daemon (``kvbridge offload serve``).

A host pool keyed by block hash (``pool``), its gRPC service (``server``), its
Prometheus metrics (``metrics``) and its command line (``cmd``).

The names below load on first use, so the CLI can build its parser from
``cmd`` without importing NIXL or gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.worker.offload.disk import RECORD_BYTES, DiskTier, unpack_record
    from kvbridge.worker.offload.pool import HostPool, OffloadStats
    from kvbridge.worker.offload.server import OffloadConfig, OffloadServer, serve

__all__ = [
    "RECORD_BYTES",
    "DiskTier",
    "unpack_record",
    "HostPool",
    "OffloadConfig",
    "OffloadServer",
    "OffloadStats",
    "serve",
]

_HOME = {
    "RECORD_BYTES": "disk",
    "DiskTier": "disk",
    "unpack_record": "disk",
    "HostPool": "pool",
    "OffloadStats": "pool",
    "OffloadConfig": "server",
    "OffloadServer": "server",
    "serve": "server",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)

"""The per-node CPU offload daemon (``kvbridge offload serve``).

A host pool keyed by block hash (``pool``), its gRPC service (``server``), its
Prometheus metrics (``metrics``) and its command line (``cmd``).
"""

from kvbridge.worker.offload.pool import HostPool, OffloadStats
from kvbridge.worker.offload.server import OffloadConfig, OffloadServer, serve

__all__ = ["HostPool", "OffloadConfig", "OffloadServer", "OffloadStats", "serve"]

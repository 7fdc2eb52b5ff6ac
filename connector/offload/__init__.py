"""Engine-side clients of the per-node CPU offload daemon (``kvbridge offload serve``).

:class:`OffloadClient` stores and loads blocks (worker half); :class:`OffloadLookup`
only asks which hashes the daemon holds (scheduler half, no transport).
"""

from kvbridge.connector.offload.client import (
    OffloadClient,
    OffloadClientConfig,
    OffloadLoadResult,
    OffloadStoreResult,
)
from kvbridge.connector.offload.lookup import OffloadLookup, OffloadLookupConfig

__all__ = [
    "OffloadClient",
    "OffloadClientConfig",
    "OffloadLoadResult",
    "OffloadLookup",
    "OffloadLookupConfig",
    "OffloadStoreResult",
]

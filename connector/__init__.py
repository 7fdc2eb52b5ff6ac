"""The engine-side connector: everything kvbridge runs inside an inference engine.

``base`` (the two seams), ``planner`` (the one planner both engines use),
``worker_side`` and ``load`` (the worker half and its loads), ``control`` (leases,
lease seals and the peer control plane),
``transport`` (the data plane), ``offload`` (clients of the offload daemon)
and ``vllm`` (the vLLM adapter).
"""

from kvbridge.connector.base import (
    BlockLoad,
    LoadResult,
    RequestView,
    SchedulerConnector,
    StepMetadata,
    WorkerConnector,
)
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.params import KVTransferParams

__all__ = [
    "BlockLoad",
    "ConnectorConfig",
    "KVTransferParams",
    "LoadResult",
    "RequestView",
    "SchedulerConnector",
    "StepMetadata",
    "WorkerConnector",
]

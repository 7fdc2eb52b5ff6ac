"""The engine-side connector: everything kvbridge runs inside an inference engine.

``base`` (the two seams), ``planner`` (which blocks to load, hand over, store),
``scheduler`` and ``worker_side`` (the reference engine's halves), ``control``
(leases and the peer control plane), ``transport`` (the data plane), ``offload``
(clients of the offload daemon) and ``vllm`` (the vLLM adapter).
"""

from kvbridge.connector.base import (
    BlockLoad,
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
    "RequestView",
    "SchedulerConnector",
    "StepMetadata",
    "WorkerConnector",
]

"""The engine-side connector: everything kvbridge runs inside an inference engine.

``base`` (the two seams), ``planner`` (the one planner both engines use),
``worker_side`` and ``load`` (the worker half and its loads), ``control`` (leases,
lease seals and the peer control plane),
``transport`` (the data plane), ``engine_side`` (how both engines assemble the
worker half, its leases and control server), ``server_options`` (every server port's
address, token and TLS), ``offload`` (clients of the offload daemon)
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
from kvbridge.connector.server_options import ServerOptions

__all__ = [
    "BlockLoad",
    "ConnectorConfig",
    "KVTransferParams",
    "LoadResult",
    "RequestView",
    "ServerOptions",
    "SchedulerConnector",
    "StepMetadata",
    "WorkerConnector",
]

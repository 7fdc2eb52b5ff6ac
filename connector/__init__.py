"""The engine-side connector: scheduler and worker halves (see :mod:`.base`)."""

from kvbridge.connector.base import (
    BlockLoad,
    RequestView,
    SchedulerConnector,
    StepMetadata,
    WorkerConnector,
)

__all__ = ["BlockLoad", "RequestView", "SchedulerConnector", "StepMetadata", "WorkerConnector"]

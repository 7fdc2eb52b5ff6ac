"""The reference engine: a small seeded Llama-style decoder on a paged KV cache.

It exists so that kvbridge runs, is tested and is benchmarked end to end on a
CPU without a model download. Read it in this order: :mod:`.config`,
:mod:`.model` and :mod:`.attention` (the math), :mod:`.request`, :mod:`.intake`,
:mod:`.block_tables` and :mod:`.scheduler` (the bookkeeping), :mod:`.engine` (the
step loop and the connector hooks).
"""

from kvbridge.worker.engine.config import ENGINE_PRESETS, EngineConfig
from kvbridge.worker.engine.engine import Engine
from kvbridge.worker.engine.request import RequestOutput, RequestStatus

__all__ = ["ENGINE_PRESETS", "Engine", "EngineConfig", "RequestOutput", "RequestStatus"]

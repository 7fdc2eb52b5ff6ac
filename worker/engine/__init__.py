"""The reference engine: a small seeded Llama-style decoder on a paged KV cache.

It exists so that kvbridge runs, is tested and is benchmarked end to end on a
CPU without a model download. Read it in this order: :mod:`.config`,
:mod:`.model` and :mod:`.attention` (the math), :mod:`.request`, :mod:`.intake`,
:mod:`.block_tables` and :mod:`.scheduler` (the bookkeeping), :mod:`.engine` (the
step loop and the connector hooks).

The names below load on first use: a command checks its flags against
:class:`EngineConfig` (and refuses a bad ``--model`` at once) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.worker.engine.config import ENGINE_PRESETS, EngineConfig
    from kvbridge.worker.engine.engine import Engine
    from kvbridge.worker.engine.request import RequestOutput, RequestStatus

_HOME = {
    "ENGINE_PRESETS": "config",
    "EngineConfig": "config",
    "Engine": "engine",
    "RequestOutput": "request",
    "RequestStatus": "request",
}

__all__ = ["ENGINE_PRESETS", "Engine", "EngineConfig", "RequestOutput", "RequestStatus"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)

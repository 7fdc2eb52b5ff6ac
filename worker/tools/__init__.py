"""Tools that drive serving nodes from outside, as a user would: not part of a deployment.

``demo`` (a prefill and a decode node on loopback, checked token for token) and
``soak`` with ``chaos`` and ``soak_config`` (many nodes under random kills and stops,
checked the same way). The workload and checks below are the demo's; tests use them too.

The names below load on first use, so the CLI can build its parser without
importing torch or gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.worker.tools.demo import (
        check_no_leaks,
        make_encoder_inputs,
        make_workload,
        reference_outputs,
    )

_HOME = {
    "check_no_leaks": "demo",
    "make_encoder_inputs": "demo",
    "make_workload": "demo",
    "reference_outputs": "demo",
}

__all__ = [
    "check_no_leaks",
    "make_encoder_inputs",
    "make_workload",
    "reference_outputs",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)

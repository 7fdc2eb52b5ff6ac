"""A kvbridge serving node and what drives it.

``node`` (reference engine + connector + PeerControl and Inference servers: one
process), ``router`` (the client that routes a request through prefill then
decode), ``demo`` (both on loopback, checked token for token), ``metrics``
(the node's Prometheus registry) and the commands ``serve`` (``node_cmd``) and
``serve-control`` (``control_cmd``).

The names below load on first use, so the CLI can build its parser from
``node_cmd`` without importing torch or gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.worker.serving.node import GenerateResult, Node, NodeConfig
    from kvbridge.worker.serving.router import RoutedResult, Router

__all__ = ["GenerateResult", "Node", "NodeConfig", "RoutedResult", "Router"]

_HOME = {
    "GenerateResult": "node",
    "Node": "node",
    "NodeConfig": "node",
    "RoutedResult": "router",
    "Router": "router",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)

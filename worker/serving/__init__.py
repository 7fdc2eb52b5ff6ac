"""A kvbridge serving node and what drives it.

``node`` (reference engine + connector + PeerControl and Inference servers: one
process), ``router`` (the client that routes a request through prefill then
decode, retrying on another node of a role when one is down), ``launch`` (nodes
and offload daemons as child processes), ``metrics`` (the node's Prometheus
registry) and the commands ``serve`` (``node_cmd``) and ``serve-control``
(``control_cmd``). The demo, soak and chaos tools that drive nodes are
:mod:`kvbridge.worker.tools`.

The names below load on first use, so the CLI can build its parser from
``node_cmd`` without importing torch or gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.worker.serving.inference import GenerateResult
    from kvbridge.worker.serving.launch import (
        OffloadDaemonProcess,
        node_process,
        start_node,
        start_offload_daemon,
    )
    from kvbridge.worker.serving.node import Node, NodeConfig
    from kvbridge.worker.serving.placement import EventPlacement
    from kvbridge.worker.serving.router import (
        EngineClient,
        NodeDownError,
        Placement,
        RoutedResult,
        Router,
        RouterConfig,
    )

_HOME = {
    "EngineClient": "router",
    "EventPlacement": "placement",
    "GenerateResult": "inference",
    "Node": "node",
    "NodeConfig": "node",
    "NodeDownError": "router",
    "OffloadDaemonProcess": "launch",
    "Placement": "router",
    "RoutedResult": "router",
    "Router": "router",
    "RouterConfig": "router",
    "node_process": "launch",
    "start_node": "launch",
    "start_offload_daemon": "launch",
}

__all__ = [
    "EngineClient",
    "EventPlacement",
    "GenerateResult",
    "Node",
    "NodeConfig",
    "NodeDownError",
    "OffloadDaemonProcess",
    "Placement",
    "RoutedResult",
    "Router",
    "RouterConfig",
    "node_process",
    "start_node",
    "start_offload_daemon",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)

"""A kvbridge serving node and what drives it.

``node`` (reference engine + connector + PeerControl and Inference servers: one
process), ``router`` (the client that routes a request through prefill then
decode), ``launch`` (nodes and offload daemons as child processes), ``demo``
(both on loopback, checked token for token) and the commands ``serve``
(``node_cmd``) and ``serve-control`` (``control_cmd``).
"""

from kvbridge.worker.serving.demo import (
    check_no_leaks,
    make_encoder_inputs,
    make_workload,
    reference_outputs,
)
from kvbridge.worker.serving.launch import (
    OffloadDaemonProcess,
    start_node,
    start_offload_daemon,
)
from kvbridge.worker.serving.node import GenerateResult, Node, NodeConfig
from kvbridge.worker.serving.router import EngineClient, RoutedResult, Router

__all__ = [
    "EngineClient",
    "GenerateResult",
    "Node",
    "NodeConfig",
    "OffloadDaemonProcess",
    "RoutedResult",
    "Router",
    "check_no_leaks",
    "make_encoder_inputs",
    "make_workload",
    "reference_outputs",
    "start_node",
    "start_offload_daemon",
]

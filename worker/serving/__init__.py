"""A kvbridge serving node and what drives it.

``node`` (reference engine + connector + PeerControl and Inference servers: one
process), ``router`` (the client that routes a request through prefill then
decode), ``demo`` (both on loopback, checked token for token) and the commands
``serve`` (``node_cmd``) and ``serve-control`` (``control_cmd``).
"""

from kvbridge.worker.serving.node import GenerateResult, Node, NodeConfig
from kvbridge.worker.serving.router import RoutedResult, Router

__all__ = ["GenerateResult", "Node", "NodeConfig", "RoutedResult", "Router"]

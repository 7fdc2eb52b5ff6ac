"""A kvbridge serving node and what drives it.

``node`` (reference engine + connector + PeerControl and Inference servers: one
process), ``router`` (the client that routes a request through prefill then
decode, retrying on another node of a role when one is down), ``demo`` (both on
loopback, checked token for token), ``soak`` with ``chaos`` (many nodes under
random kills and stops, checked the same way) and the commands ``serve``
(``node_cmd``) and ``serve-control`` (``control_cmd``).
"""

from kvbridge.worker.serving.node import GenerateResult, Node, NodeConfig
from kvbridge.worker.serving.router import NodeDownError, RoutedResult, Router, RouterConfig

__all__ = [
    "GenerateResult",
    "Node",
    "NodeConfig",
    "NodeDownError",
    "RoutedResult",
    "Router",
    "RouterConfig",
]

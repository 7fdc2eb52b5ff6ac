"""kvbridge inside vLLM: ``kv_connector_module_path = "kvbridge.connector.vllm"``.

:class:`KVBridgeConnector` (in ``connector``, its stats classes in ``metrics``) is the
only code that imports vLLM; it is loaded on first access so that the two halves
(``scheduler``, ``worker``) and ``config`` can be imported and tested without vLLM
installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.connector.vllm.connector import KVBridgeConnector, KVBridgeMetadata
    from kvbridge.connector.vllm.views import logical_views

__all__ = ["KVBridgeConnector", "KVBridgeMetadata", "logical_views"]


def __getattr__(name: str) -> Any:
    if name == "logical_views":
        from kvbridge.connector.vllm import views

        return views.logical_views
    if name in __all__:
        from kvbridge.connector.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

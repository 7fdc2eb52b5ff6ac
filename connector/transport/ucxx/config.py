"""Settings, state snapshots and the lazy UCXX import of the UCXX transport.

Kept apart from :mod:`kvbridge.connector.transport.ucxx.transport` so that the service side
(:mod:`kvbridge.connector.transport.ucxx.service`) can use the config without importing the
transport. Importing this module loads neither ucxx nor torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.proto import codec
from kvbridge.proto.errors import ConfigError, LayoutError

if TYPE_CHECKING:
    import torch

__all__ = ["UcxxConfig", "UcxxStats", "check_host_memory", "load_ucxx"]


def load_ucxx() -> tuple[Any, Any]:
    """Import UCXX's synchronous API lazily: ``(ucxx._lib.libucxx, ucxx._lib.arr.Array)``.

    Sets ``UCX_MODULES=^ib`` (without it processes segfault at exit here) and host
    staging for rendezvous unless the environment says otherwise, and drops the
    ``UCX_MEMTYPE_CACHE`` knob UCXX sets at import, which this UCX no longer knows (it would warn
    at every context).
    """
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
    memtype_preset = "UCX_MEMTYPE_CACHE" in os.environ
    try:
        import ucxx._lib.libucxx as lib
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise ConfigError(
            "UCXX is not installed: pip install 'kvbridge[ucxx]' (ucxx-cu12, which also runs "
            "without a GPU), or use the NIXL transport"
        ) from exc
    if not memtype_preset:
        os.environ.pop("UCX_MEMTYPE_CACHE", None)
    return lib, Array


def check_host_memory(kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Raise LayoutError unless every tensor is in host memory (this transport is host-only)."""
    for name, tensor in kv_caches.items():
        if tensor.device.type != "cpu":
            raise LayoutError(
                f"tensor {name!r} is on {tensor.device}; the UCXX transport here is host-only "
                "(tagged send/receive of host memory): register CPU tensors, or use the NIXL "
                "transport for device memory"
            )


@dataclass(frozen=True, slots=True)
class UcxxConfig:
    """Settings of one process's UCXX transport; built once at the edge."""

    name: str
    idle_wait_s: float = 0.005
    connect_timeout_s: float = 10.0
    max_message_bytes: int = codec.MAX_MESSAGE_BYTES
    max_serve_s: float = 600.0
    coalesce: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("UcxxConfig.name must be a non-empty agent name, unique per process")
        if not 0 < self.idle_wait_s <= 1:
            raise ConfigError(
                f"UcxxConfig.idle_wait_s={self.idle_wait_s} must be in (0, 1] seconds"
            )
        if not self.connect_timeout_s > 0:
            raise ConfigError(
                f"UcxxConfig.connect_timeout_s={self.connect_timeout_s} must be > 0 seconds"
            )
        if not 4096 <= self.max_message_bytes <= 1 << 30:
            raise ConfigError(
                f"UcxxConfig.max_message_bytes={self.max_message_bytes} must be in 4096..2**30"
            )
        if not self.max_serve_s > 0:
            raise ConfigError(f"UcxxConfig.max_serve_s={self.max_serve_s} must be > 0 seconds")


@dataclass(frozen=True, slots=True)
class UcxxStats:
    """A snapshot of one transport's state, for tests and logs (:meth:`UcxxTransport.stats`).

    ``abandoned`` counts requests and endpoint closes still unfinished when
    :meth:`UcxxTransport.close` stopped waiting for them (0 after a clean close).
    """

    pending: int
    links: int
    links_down: int
    tables: int
    peers: tuple[str, ...]
    served: int
    rejected: int
    strays: int
    abandoned: int

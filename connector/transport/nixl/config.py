"""Settings and the lazy NIXL import of the NIXL transport.

Used by :mod:`kvbridge.connector.transport.nixl.agent` (which loads NIXL when
a transport is made) and by whoever builds a transport at the edge (the
serving node, the offload daemon, the vLLM worker, benchmarks). Importing
this module loads neither nixl nor torch.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from kvbridge.proto.errors import ConfigError

__all__ = ["NIXL_MODULES", "NixlConfig", "load_nixl"]

NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
"""Where NIXL's Python API may live, tried in this order: the CUDA 12 wheel
(``nixl-cu12``), the CUDA 13 wheel (``nixl-cu13``), a source build (``nixl``)."""


def load_nixl() -> Any:
    """Import NIXL's Python API lazily: the first of :data:`NIXL_MODULES` installed.

    Sets ``UCX_MODULES=^ib`` first unless the environment says otherwise:
    without it every process segfaults at exit on these machines. On a machine
    with an NVIDIA driver it also sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on``
    unless set: UCX's default (``auto``) turns CUDA IPC reads off on GPUs
    without NVLink, and a READ of another process's VRAM on the same GPU then
    falls back to a software path (0.6 GB/s measured on an H200, see
    docs/GPU.md); decode pulls KV with READs.
    """
    os.environ.setdefault("UCX_MODULES", "^ib")
    if _has_nvidia_driver():
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError(
        "NIXL is not installed: pip install 'kvbridge[cu12]' (CUDA 12 or CPU only) or "
        "'kvbridge[cu13]' (CUDA 13)"
    )


def _has_nvidia_driver() -> bool:
    """Whether this machine has an NVIDIA driver (its control device), without loading CUDA."""
    return os.path.exists("/dev/nvidiactl")


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """Settings of one process's NIXL transport; built once at the edge.

    ``strided_descriptors`` preps NIXL's compressed Nx5 lists (one row per
    region, :func:`~kvbridge.connector.transport.nixl_descs.strided_table`) instead of
    one Nx3 row per descriptor (:func:`~kvbridge.connector.transport.nixl_descs.descriptor_table`);
    both move the same bytes with the same descriptors. See DESIGN-NOTES.md,
    "NIXL descriptor lists".

    ``native_progress`` runs NIXL's own progress thread, woken by UCX's event file
    descriptor (:mod:`~kvbridge.connector.transport.nixl.progress`): a peer's READ that
    waits on this process (its flush after a notification, over TCP) completes as its
    message arrives, without this process's interpreter lock. While it runs, the Python
    loop of ``progress_interval_s`` is not started (it would only repeat it); without it,
    that loop is what progresses UCX for peers. See DESIGN-NOTES.md, "A READ after a
    notification waits for the peer". Off by default: measured idle in real vLLM it made
    the long prompts' KV READ 3.4x NixlConnector's (0.97x without it) and gave the demo
    nothing the decode's flush READ after each release does not already give.
    """

    name: str
    progress_interval_s: float | None = 0.002
    backends: tuple[str, ...] = ("UCX",)
    strided_descriptors: bool = True
    native_progress: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("NixlConfig.name must be a non-empty agent name, unique per process")
        if self.progress_interval_s is not None and not 0 < self.progress_interval_s <= 1:
            raise ConfigError(
                f"NixlConfig.progress_interval_s={self.progress_interval_s} must be in (0, 1] "
                "seconds, or None for no background progress thread"
            )
        if not self.backends:
            raise ConfigError("NixlConfig.backends must name at least one NIXL backend")
        if not isinstance(self.strided_descriptors, bool):
            raise ConfigError(
                f"NixlConfig.strided_descriptors={self.strided_descriptors!r} must be True "
                "(compressed Nx5 descriptor lists) or False (one Nx3 row per descriptor)"
            )
        if not isinstance(self.native_progress, bool):
            raise ConfigError(
                f"NixlConfig.native_progress={self.native_progress!r} must be True (NIXL's "
                "own event-driven progress thread) or False (kvbridge's Python loop only)"
            )

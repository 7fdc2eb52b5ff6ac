"""``OffloadConfig``: the offload daemon's settings, and the pool layout they imply.

Built once at the edge (``kvbridge offload serve`` flags) and validated here;
read by the daemon's handlers and its gRPC server
(:mod:`kvbridge.worker.offload.server`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvbridge.connector.control.server_config import MAX_TTL_CEILING_S
from kvbridge.connector.control.types import ControlLimits
from kvbridge.connector.server_options import ServerOptions
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.layout import KVGroup, KVLayout, parse_order

__all__ = ["GROUP", "OffloadConfig", "pool_layout"]

GROUP = KVGroup.SELF
"""The only group the daemon holds."""


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """The offload daemon's settings (built once at the edge: ``kvbridge offload serve``)."""

    capacity_bytes: int = 8 << 30
    listen: ServerOptions = field(default_factory=ServerOptions)
    """Where the daemon listens, the token every call must carry (metadata
    ``kvbridge-token``; a :class:`~kvbridge.connector.control.auth.TokenSet` from a token
    file accepts each of its tokens, each a separate peer), TLS."""
    layout: KVLayout | None = None
    """Allocate the pool at start in this layout (block counts ignored); None: at the first
    (authenticated) handshake, in that worker's layout."""
    order: tuple[str, ...] | None = None
    """Pool order; None: block-outermost with the (first) worker's inner order."""
    default_ttl_s: float = 30.0
    max_ttl_s: float = 300.0
    reap_interval_s: float = 0.5
    commit_wait_s: float = 1.0
    """How long CommitStore waits for the writer's WRITE notification before refusing."""
    max_workers: int = 8
    max_concurrent_rpcs: int = 256
    idle_timeout_s: float = 300.0
    """Close a client connection idle this long (it reconnects on its next call)."""
    max_pending: int = 4096
    max_sessions: int = 256
    max_sessions_per_peer: int = 64
    """Sessions one peer (authenticated identity: one token, or one host without a token)
    may hold, under whatever agent names; past it the peer's own oldest session goes."""
    max_stores_per_writer: int = 64
    """Prepared, not yet committed stores one peer may hold: a peer is the caller's
    authenticated identity (a hash of its token; its host when the daemon has no token),
    so every worker and agent name under one token shares this cap."""
    max_pinned_per_writer: int | None = None
    """Blocks one peer (as above) may keep pinned by loads; None: the whole pool (a lone
    peer may load all of it; with many, give each its own token and cap this so none can
    pin the others' room away)."""
    expired_grace_s: float = 60.0
    """How long the slots of a store that expired or was aborted before its WRITE completed
    stay out of the free list: a paused writer's late WRITE then lands in a slot nobody
    else uses. Readers verify digests anyway; this only makes the late write harmless
    instead of detected (and recomputed)."""
    disk_path: str | None = None
    """Directory of the disk tier under the host pool (``--disk``); None: no disk tier."""
    disk_capacity_bytes: int = 64 << 30
    limits: ControlLimits = field(default_factory=ControlLimits)

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1:
            raise ConfigError(f"capacity_bytes must be >= 1, got {self.capacity_bytes}")
        if self.order is not None:
            parse_order(self.order)
        if not (math.isfinite(self.max_ttl_s) and 0 < self.max_ttl_s <= MAX_TTL_CEILING_S):
            # a store or load holds pool memory; beyond a day nothing is still writing or
            # reading, and every TTL must fit the replies' millisecond fields
            raise ConfigError(
                f"--max-ttl (max_ttl_s) {self.max_ttl_s:g} must be a finite number of seconds > 0 "
                f"and at most {MAX_TTL_CEILING_S:g} (one day)"
            )
        if not 0 < self.default_ttl_s <= self.max_ttl_s:
            raise ConfigError(
                f"--default-ttl {self.default_ttl_s:g} must be > 0 and at most --max-ttl "
                f"{self.max_ttl_s:g}"
            )
        for knob in ("reap_interval_s", "idle_timeout_s"):
            if not (math.isfinite(getattr(self, knob)) and getattr(self, knob) > 0):
                raise ConfigError(f"{knob} must be > 0, got {getattr(self, knob)}")
        if not (math.isfinite(self.expired_grace_s) and self.expired_grace_s >= 0):
            raise ConfigError(f"expired_grace_s must be >= 0, got {self.expired_grace_s}")
        if self.disk_capacity_bytes < 1:
            raise ConfigError(f"--disk-capacity must be >= 1 byte, got {self.disk_capacity_bytes}")
        if self.commit_wait_s < 0:
            raise ConfigError(f"commit_wait_s must be >= 0, got {self.commit_wait_s}")
        for knob in (
            "max_workers",
            "max_concurrent_rpcs",
            "max_pending",
            "max_sessions",
            "max_sessions_per_peer",
            "max_stores_per_writer",
        ):
            if getattr(self, knob) < 1:
                raise ConfigError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        if self.max_pinned_per_writer is not None and self.max_pinned_per_writer < 1:
            raise ConfigError(
                f"max_pinned_per_writer must be >= 1, got {self.max_pinned_per_writer}"
            )


def pool_layout(template: KVLayout, config: OffloadConfig) -> KVLayout:
    """The daemon's pool layout for workers like ``template``, sized by the capacity."""
    order = config.order or ("B", "L", "KV", *template.inner_order)
    one = {g.name: 1 for g in template.groups}
    probe = replace(template, tp_rank=0, regions=(), _cache={}).with_order(order)
    probe = probe.with_num_blocks(**one)
    block_bytes = probe.block_bytes(GROUP)
    num_blocks = config.capacity_bytes // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"capacity of {config.capacity_bytes} bytes holds no {block_bytes}-byte block of "
            f"{template.model.name}; raise --capacity"
        )
    return probe.with_num_blocks(**{GROUP: num_blocks})

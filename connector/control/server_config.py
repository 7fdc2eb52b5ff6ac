"""How a peer control server listens and what it allows (:class:`ControlServerConfig`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvbridge.connector.control.types import ControlLimits
from kvbridge.connector.server_options import ServerOptions
from kvbridge.proto.errors import ConfigError

__all__ = ["MAX_TTL_CEILING_S", "ControlServerConfig"]

MAX_TTL_CEILING_S = 86_400.0
"""The longest ``max_ttl_s`` a control server accepts (one day)."""


@dataclass(frozen=True, slots=True)
class ControlServerConfig:
    """How the control server listens and what it allows (built once at the edge)."""

    listen: ServerOptions = field(default_factory=ServerOptions)
    """Where the server listens, the token callers must send, TLS."""
    max_workers: int = 8
    max_concurrent_rpcs: int = 256
    default_ttl_s: float = 30.0
    max_ttl_s: float = 600.0
    reap_interval_s: float = 0.5
    max_lease_lifetime_s: float | None = None
    """No peer's Heartbeat or Pin extends a lease past its creation + this; None:
    ``max_ttl_s``. Bounds how long one hand-over can be held, however often it is pinned."""
    max_leases_per_peer: int = 1024
    """Most leases one peer (authenticated identity, see ``caller_identity``) may hold
    through Pin, hand-overs it claimed included."""
    max_blocks_per_peer: int | None = None
    """Most blocks one peer may pin through Pin; None: half of the owner's blocks."""
    max_digest_waits: int | None = None
    """Most ``Digests`` calls that wait at once for a lease the owner has not made yet (each
    holds a server thread up to ``DIGESTS_WAIT_S``); None: half of ``max_workers`` (at
    least 1), so the other half always serves. Calls over the cap answer busy at once
    (RESOURCE_EXHAUSTED; the client asks again within its deadline)."""
    max_digest_waits_per_peer: int = 2
    """Of those, most from one peer (authenticated identity)."""
    limits: ControlLimits = field(default_factory=ControlLimits)

    def __post_init__(self) -> None:
        for knob in ("max_workers", "max_concurrent_rpcs"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        if not 0 < self.default_ttl_s <= self.max_ttl_s or not math.isfinite(self.max_ttl_s):
            # an infinite cap lets any caller pin for as long as its ttl_ms field can say
            raise ConfigError(
                f"need 0 < default_ttl_s ({self.default_ttl_s}) <= max_ttl_s ({self.max_ttl_s}), "
                "max_ttl_s finite"
            )
        if self.max_ttl_s > MAX_TTL_CEILING_S:
            # a lease pins KV memory; beyond a day no load is still reading, and the
            # figure must fit the replies' millisecond fields
            raise ConfigError(
                f"max_ttl_s {self.max_ttl_s:g} exceeds {MAX_TTL_CEILING_S:g} s (one day): "
                "pick a shorter --max-lease-ttl"
            )
        lifetime = self.max_lease_lifetime_s
        if lifetime is not None and not (math.isfinite(lifetime) and lifetime > 0):
            raise ConfigError(f"max_lease_lifetime_s must be finite and > 0, got {lifetime}")
        if self.max_leases_per_peer < 1:
            raise ConfigError(f"max_leases_per_peer must be >= 1, got {self.max_leases_per_peer}")
        if self.max_blocks_per_peer is not None and self.max_blocks_per_peer < 1:
            raise ConfigError(f"max_blocks_per_peer must be >= 1, got {self.max_blocks_per_peer}")
        waits = self.max_digest_waits
        if (waits is not None and waits < 1) or self.max_digest_waits_per_peer < 1:
            raise ConfigError(
                f"max_digest_waits ({waits}) and max_digest_waits_per_peer "
                f"({self.max_digest_waits_per_peer}) must be >= 1"
            )
        if not (math.isfinite(self.reap_interval_s) and self.reap_interval_s > 0):
            raise ConfigError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")

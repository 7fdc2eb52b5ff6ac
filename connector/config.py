"""``ConnectorConfig``: how one engine's kvbridge connector behaves (built once at the edge)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbridge.connector.addresses import parse_allowed_peers
from kvbridge.connector.server_options import check_token
from kvbridge.proto.errors import ConfigError

__all__ = ["ConnectorConfig", "DEFAULT_MAX_CONCURRENT_LOADS", "ROLES", "LOAD_ERROR_POLICIES"]

ROLES = ("prefill", "decode", "both")
LOAD_ERROR_POLICIES = ("recompute", "fail")
DEFAULT_MAX_CONCURRENT_LOADS = 4
"""Loads (and offload stores) one engine runs at once; also the cap on handshakes with new
peers in flight. Loads mostly wait on the network and the peer, so a few overlap well even
on two cores."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Settings of a kvbridge connector; every knob is validated here and named on error."""

    engine_id: str
    role: str = "both"
    control_address: str = ""
    """Where this engine's control server listens (host:port), put into kv_transfer_params."""
    token: str | None = None
    """Shared token sent to (and required from) peers; only ever sent to allowed peers."""
    tls_root_cert: bytes | None = None
    """PEM roots that peers' control servers must present a certificate from (None: plaintext)."""
    allowed_peers: tuple[str, ...] = ()
    """Control addresses (HOST:PORT) decode may dial; empty: loopback addresses only."""
    lease_ttl_s: float = 30.0
    max_lease_ttl_s: float = 600.0
    """Longest lease a peer may ask our control server for (longer requests are clamped)."""
    load_timeout_s: float = 10.0
    control_timeout_s: float = 5.0
    stall_before_read_s: float = 0.0
    """Test hook: sleep this long between the owner's answer and the READ, as a decode
    stalled by GC, SIGSTOP or CPU starvation would (0 in production)."""
    on_load_error: str = "recompute"
    max_concurrent_loads: int = DEFAULT_MAX_CONCURRENT_LOADS
    offload_address: str = ""
    """host:port of the node's CPU offload daemon; empty: no offloading."""
    offload_verify: bool = True
    """Check every block loaded from the offload daemon against its writer's digest before
    the engine uses it (default); False trusts the daemon's memory."""
    verify_loads: bool = True
    """Prefill records a keyed digest of every block it hands over; decode checks each block
    it READ against it before the engine uses it, and recomputes a block that differs
    (docs/DESIGN-NOTES.md, "Trust"). False: neither side digests (saves the digest time on
    both sides; a peer that WRITEs registered memory can then change decoded tokens)."""

    def __post_init__(self) -> None:
        if not self.engine_id or len(self.engine_id) > 128:
            raise ConfigError("engine_id must be 1..128 characters, unique per engine")
        if self.role not in ROLES:
            raise ConfigError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.on_load_error not in LOAD_ERROR_POLICIES:
            raise ConfigError(
                f"on_load_error {self.on_load_error!r} is not one of "
                f"{', '.join(LOAD_ERROR_POLICIES)}"
            )
        for knob in ("lease_ttl_s", "load_timeout_s", "control_timeout_s", "max_lease_ttl_s"):
            value = getattr(self, knob)
            if not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
                # NaN passed every comparison below: a lease that never expires
                raise ConfigError(f"{knob} must be a finite number > 0, got {value!r}")
        if self.load_timeout_s >= self.lease_ttl_s:
            raise ConfigError(
                f"load_timeout_s ({self.load_timeout_s}) must be shorter than lease_ttl_s "
                f"({self.lease_ttl_s}), or a lease could expire under a running read"
            )
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ConfigError(
                f"lease_ttl_s ({self.lease_ttl_s}) must not exceed max_lease_ttl_s "
                f"({self.max_lease_ttl_s})"
            )
        check_token(self.token)
        if not isinstance(self.verify_loads, bool):
            raise ConfigError(f"verify_loads must be true or false, got {self.verify_loads!r}")
        if self.max_concurrent_loads < 1:
            raise ConfigError("max_concurrent_loads must be >= 1")
        if isinstance(self.allowed_peers, str):
            raise ConfigError("allowed_peers must be a list of HOST:PORT, not one string")
        peers = parse_allowed_peers(self.allowed_peers, "allowed_peers")
        object.__setattr__(self, "allowed_peers", peers)

    @property
    def produces(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("decode", "both")

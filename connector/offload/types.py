"""The offload client's settings and results (see :mod:`kvbridge.connector.offload.client`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.connector.control.types import ControlLimits, Role
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.types import BlockHash

__all__ = ["OffloadClientConfig", "OffloadLoadResult", "OffloadStoreResult"]


@dataclass(frozen=True, slots=True)
class OffloadClientConfig:
    """How a worker talks to its offload daemon (built once at the edge)."""

    address: str = "127.0.0.1:50060"
    engine_id: str = "kvbridge-worker"
    role: Role = Role.BOTH
    rpc_timeout_s: float = 2.0
    handshake_timeout_s: float = 60.0
    """The first handshake may wait while the daemon allocates and registers its pool."""
    transfer_timeout_s: float = 10.0
    ttl_s: float = 30.0
    """How long the daemon keeps a store's slots / a load's pins; > 2x transfer_timeout_s."""
    reconnect_backoff_s: float = 0.5
    verify: bool = True
    """Check every loaded block against its writer's digest after the READ (default). Off
    trusts the daemon's memory: any NIXL peer's WRITE into it, or a paused writer's late
    one, is then decoded from unnoticed."""
    token: str | None = None
    """The daemon's shared token (``kvbridge offload serve --token``); None: no auth."""
    root_cert: bytes | None = None
    """PEM of the CA of the daemon's TLS certificate; None: plaintext."""
    server_name: str | None = None
    """Name to check the daemon's certificate against (default: the address's host)."""
    limits: ControlLimits = field(default_factory=ControlLimits)

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError("OffloadClientConfig.address must be host:port of the daemon")
        if self.token is not None and (not self.token.isascii() or not self.token.isprintable()):
            raise ConfigError("OffloadClientConfig.token must be printable ASCII")
        for knob in ("rpc_timeout_s", "handshake_timeout_s", "transfer_timeout_s", "ttl_s"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"OffloadClientConfig.{knob} must be > 0")
        if self.ttl_s < 2 * self.transfer_timeout_s:
            raise ConfigError(
                f"OffloadClientConfig.ttl_s={self.ttl_s} must be >= 2 x transfer_timeout_s "
                f"({self.transfer_timeout_s}) so a slot never expires under a transfer"
            )
        if self.reconnect_backoff_s < 0:
            raise ConfigError("OffloadClientConfig.reconnect_backoff_s must be >= 0")


@dataclass(frozen=True, slots=True)
class OffloadStoreResult:
    """What one :meth:`OffloadClient.store` did.

    ``stored``: blocks written and committed; ``skipped``: blocks not written
    (already held, being written by another worker, or no room);
    ``evicted``: hashes the daemon dropped to make room. ``error`` is set when
    the store failed (then ``stored`` is 0 and nothing became visible).
    """

    stored: int = 0
    skipped: int = 0
    evicted: tuple[BlockHash, ...] = ()
    nbytes: int = 0
    elapsed_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True, slots=True)
class OffloadLoadResult:
    """What one :meth:`OffloadClient.load` did: ``block_ids[:loaded]`` now hold the blocks
    of ``hashes[:loaded]``; anything after is untouched or garbage (recompute it).

    ``bad_digest``: blocks whose bytes did not match their writer's digest (the first
    one and every block after it are not counted in ``loaded``); ``verify_s``: time the
    digest check took (0 with verification off)."""

    loaded: int = 0
    nbytes: int = 0
    elapsed_s: float = 0.0
    error: str = ""
    bad_digest: int = 0
    verify_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error

"""The knobs of one soak run (:mod:`kvbridge.worker.tools.soak`), read by the soak and by
the deployment it puts under chaos (:mod:`kvbridge.worker.tools.chaos`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.proto.errors import ConfigError

__all__ = ["SoakConfig"]


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """One soak run; every knob is validated here and named on error."""

    duration_s: float = 120.0
    seed: int = 0
    prefill_nodes: int = 2
    decode_nodes: int = 2
    concurrency: int = 2
    lease_ttl_s: float = 3.0
    load_timeout_s: float = 2.0
    attempt_timeout_s: float = 15.0
    attempts: int = 3
    max_tokens: int = 4
    prompts: int = 48
    prefixes: int = 6
    offload: bool = True

    def __post_init__(self) -> None:
        for knob in ("duration_s", "lease_ttl_s", "load_timeout_s", "attempt_timeout_s"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{knob} must be > 0, got {getattr(self, knob)}")
        for knob in ("prefill_nodes", "decode_nodes", "concurrency", "attempts", "prompts"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        if self.max_tokens < 2:
            raise ConfigError(f"max_tokens must be >= 2 (decode must run), got {self.max_tokens}")
        if self.load_timeout_s >= self.lease_ttl_s:
            raise ConfigError(
                f"load_timeout_s ({self.load_timeout_s}) must be shorter than lease_ttl_s "
                f"({self.lease_ttl_s})"
            )

    @property
    def spare(self) -> bool:
        """A spare node of each role: every request should then be answered."""
        return self.prefill_nodes >= 2 and self.decode_nodes >= 2

    @property
    def hang_s(self) -> float:
        """The router's worst case for one request (both hops, every attempt), plus slack."""
        return 2 * self.attempts * self.attempt_timeout_s + 10.0

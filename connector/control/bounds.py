"""What bounds one peer's state in a lease table: its caps, who it is, what it holds.

Split from :mod:`.leases`, which charges each peer's leases here: a peer is the
caller's authenticated identity
(:func:`~kvbridge.connector.control.auth.caller_identity`).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvbridge.proto.errors import ConfigError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId

__all__ = ["Claimant", "PeerCaps", "PeerUse", "WaitSlots", "block_keys", "check_ttl"]


@dataclass(frozen=True, slots=True)
class PeerCaps:
    """Most leases and pinned blocks one peer may hold at once."""

    max_leases: int
    max_blocks: int

    def __post_init__(self) -> None:
        for knob in ("max_leases", "max_blocks"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"per-peer {knob} must be >= 1, got {getattr(self, knob)}")


@dataclass(frozen=True, slots=True)
class Claimant:
    """A peer asking to extend (or claim) leases: who it is and what bounds it."""

    peer: str
    """The caller's authenticated identity (see ``caller_identity``)."""
    caps: PeerCaps | None = None
    """Charged when it claims an owner-made hand-over lease."""
    max_lifetime_s: float = math.inf
    """No extension reaches past the lease's creation + this."""


@dataclass(slots=True)
class PeerUse:
    """What one peer's leases hold: how many, and each block with its lease count."""

    leases: int = 0
    blocks: Counter[tuple[str, BlockId]] = field(default_factory=Counter)


def block_keys(blocks: Mapping[KVGroup, Sequence[BlockId]]) -> list[tuple[str, BlockId]]:
    return [(group, b) for group, ids in blocks.items() for b in ids]


def check_ttl(ttl_s: float) -> None:
    # NaN passes `<= 0` and would sit at the deadline heap's root forever, never expiring,
    # and keeping every later lease from expiring too; infinity would never expire either
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ConfigError(f"lease ttl_s must be a finite number > 0, got {ttl_s}")


class WaitSlots:
    """How many calls may wait at once on a server thread (``Digests`` for a lease whose
    hold order has not reached the owner yet): at most ``total`` in all and ``per_peer``
    per caller identity. A call over either cap does not wait: it gets the answer as it
    stands now (for an unknown lease, NOT_FOUND: its reader recomputes). So a token holder
    flooding unknown leases parks at most ``per_peer`` threads, and all peers together
    ``total``, never the whole pool. Thread-safe; keeps an entry only per waiting peer."""

    def __init__(self, total: int, per_peer: int) -> None:
        if total < 1 or per_peer < 1:
            raise ConfigError(f"wait slots must be >= 1, got total {total}, per peer {per_peer}")
        self.total = total
        self.per_peer = per_peer
        self._lock = threading.Lock()
        self._waiting: Counter[str] = Counter()

    @contextmanager
    def slot(self, peer: str) -> Iterator[bool]:
        """Whether ``peer`` may wait now; the slot is held until the block ends."""
        with self._lock:
            got = self._waiting.total() < self.total and self._waiting[peer] < self.per_peer
            if got:
                self._waiting[peer] += 1
        try:
            yield got
        finally:
            if got:
                with self._lock:
                    self._waiting[peer] -= 1
                    if not self._waiting[peer]:
                        del self._waiting[peer]

    def waiting(self) -> int:
        """Calls waiting now (all peers)."""
        with self._lock:
            return self._waiting.total()

"""What each peer of the offload daemon holds, against its caps.

Kept by :class:`~kvbridge.worker.offload.pool.HostPool` under its lock (offload
daemon process): prepared stores and pinned blocks per peer (the caller's
authenticated identity: one per token, however many worker sessions and agent
names use it), so one peer cannot take the whole pool's room from the others.
Maps hold no entry per idle peer: they stay as small as the work in flight.
"""

from __future__ import annotations

from kvbridge.proto.errors import ConfigError, ControlPlaneError, LeaseError

__all__ = ["Quotas", "lease_gone"]


class Quotas:
    """Per-peer counts of prepared stores and pinned blocks; not thread-safe (the pool
    locks). The config knobs keep their ``_per_writer`` names."""

    def __init__(self, max_stores: int, max_pinned: int) -> None:
        if max_stores < 1:
            raise ConfigError(f"max_stores_per_writer must be >= 1, got {max_stores}")
        if max_pinned < 1:
            raise ConfigError(f"max_pinned_per_writer must be >= 1, got {max_pinned}")
        self.max_stores = max_stores
        self.max_pinned = max_pinned
        self.stores: dict[str, int] = {}  # peer -> prepared stores
        self.pins: dict[str, int] = {}  # peer -> pinned blocks

    def of(self, writer: str) -> tuple[int, int]:
        return self.stores.get(writer, 0), self.pins.get(writer, 0)

    def take_store(self, writer: str) -> None:
        """Count one more prepared store; RESOURCE_EXHAUSTED (nothing changes) at the cap."""
        held = self.stores.get(writer, 0)
        if held >= self.max_stores:
            raise ControlPlaneError(
                f"this peer (its token, all its sessions together) holds {held} prepared "
                "stores, the daemon's max_stores_per_writer: commit or abort some first",
                code="RESOURCE_EXHAUSTED",
            )
        self.stores[writer] = held + 1

    def pin_room(self, writer: str) -> int:
        """Blocks ``writer`` may still pin; RESOURCE_EXHAUSTED if none."""
        held = self.pins.get(writer, 0)
        if held >= self.max_pinned:
            raise ControlPlaneError(
                f"this peer (its token, all its sessions together) pins {held} blocks, the "
                "daemon's max_pinned_per_writer: complete some loads first",
                code="RESOURCE_EXHAUSTED",
            )
        return self.max_pinned - held

    def pin(self, writer: str, n: int) -> None:
        self.pins[writer] = self.pins.get(writer, 0) + n

    def drop_store(self, writer: str) -> None:
        _decrement(self.stores, writer, 1)

    def unpin(self, writer: str, n: int) -> None:
        _decrement(self.pins, writer, n)

    def clear(self) -> None:
        self.stores.clear()
        self.pins.clear()


def _decrement(counts: dict[str, int], writer: str, n: int) -> None:
    left = counts[writer] - n
    if left:
        counts[writer] = left
    else:
        del counts[writer]


def lease_gone(what: str, ident: str) -> LeaseError:
    """NOT_FOUND for a store or load that is unknown, expired or finished."""
    err = LeaseError(
        f"{what} {ident[:64]!r} is unknown, expired or already finished; "
        f"its slots were freed: prepare the {what} again"
    )
    err.code = "NOT_FOUND"
    return err

"""Negotiating a transfer mode between two peers' layouts (DESIGN.md §2).

- ``WHOLE_BLOCK``: same identity, both block-outermost with the same order:
  one descriptor per block.
- ``PER_SPAN``: same identity and inner order (N/H/C) but a different outer
  order: one descriptor per (owning layer, K/V) span, paired in canonical order.
- ``REARRANGE``: same identity, different inner order: move, then permute
  with a kernel (:func:`kvbridge.kernels.convert_blocks`).
- ``INCOMPATIBLE``: identity differs; ``reason`` names the field and both values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.proto.errors import IncompatibleLayoutError

if TYPE_CHECKING:
    from kvbridge.proto.layout import KVLayout

__all__ = ["TransferMode", "Negotiation", "negotiate"]


class TransferMode(enum.Enum):
    WHOLE_BLOCK = "whole_block"
    PER_SPAN = "per_span"
    REARRANGE = "rearrange"
    INCOMPATIBLE = "incompatible"


@dataclass(frozen=True, slots=True)
class Negotiation:
    mode: TransferMode
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.mode is not TransferMode.INCOMPATIBLE

    def raise_if_incompatible(self) -> None:
        if not self.ok:
            raise IncompatibleLayoutError(self.reason)


def _mismatch(local: KVLayout, remote: KVLayout) -> str | None:
    lm, rm = local.model, remote.model
    pairs: list[tuple[str, object, object]] = [
        ("model.name", lm.name, rm.name),
        ("model.dtype", lm.dtype, rm.dtype),
        ("model.num_layers", lm.num_layers, rm.num_layers),
        ("model.num_kv_heads", lm.num_kv_heads, rm.num_kv_heads),
        ("model.head_size", lm.head_size, rm.head_size),
        ("block_size", local.block_size, remote.block_size),
        ("tp_size", local.tp_size, remote.tp_size),
        ("groups", [g.name for g in local.groups], [g.name for g in remote.groups]),
    ]
    for name, a, b in pairs:
        if a != b:
            return f"{name} differs: local {a!r}, remote {b!r}"
    for a, b in zip(local.layers, remote.layers, strict=True):
        if a != b:
            return (
                f"layer differs: local {a.name!r} (group {a.group}, kv_source {a.kv_source}), "
                f"remote {b.name!r} (group {b.group}, kv_source {b.kv_source})"
            )
    return None


def negotiate(local: KVLayout, remote: KVLayout) -> Negotiation:
    """How ``local`` moves blocks to or from ``remote``; symmetric in the mode chosen."""
    reason = _mismatch(local, remote)
    if reason is not None:
        return Negotiation(TransferMode.INCOMPATIBLE, reason)
    if local.inner_order != remote.inner_order:
        return Negotiation(
            TransferMode.REARRANGE,
            f"inner order differs: local {' '.join(local.inner_order)}, "
            f"remote {' '.join(remote.inner_order)}",
        )
    if local.order == remote.order and local.block_outermost:
        return Negotiation(TransferMode.WHOLE_BLOCK)
    return Negotiation(
        TransferMode.PER_SPAN,
        f"outer order differs or is not block-outermost: local {' '.join(local.order)}, "
        f"remote {' '.join(remote.order)}",
    )

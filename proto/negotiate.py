"""Negotiating a transfer mode between two peers' layouts (docs/DESIGN-NOTES.md, "Negotiation").

- ``WHOLE_BLOCK``: same identity, both block-outermost with the same order:
  one descriptor per block.
- ``PER_SPAN``: same identity and inner order (N/H/C) but a different outer
  order: one descriptor per (owning layer, K/V) span, paired in canonical order.
- ``REARRANGE``: same identity, different inner order: move, then permute
  with a kernel (:func:`kvbridge.kernels.convert_blocks`).
- ``HEAD_SLICE``: same identity except the tensor-parallel size, which one
  side's divides: one side's page per (owning layer, block) is one contiguous
  slice of the other's (:func:`head_slices`). Only for vLLM's packed head-major
  pages (model name ending ``|vllm-packed-kv``: a page is ``(H, N, 2C)``, so
  the bytes of a run of heads are one span) in a layout where a page is one
  dense span (``KV`` third in the order).
- ``INCOMPATIBLE``: identity differs; ``reason`` names the field and both values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.proto.errors import IncompatibleLayoutError

if TYPE_CHECKING:
    from kvbridge.proto.layout_core import LayoutCore
    from kvbridge.proto.specs import KVGroup

__all__ = [
    "HEAD_MAJOR_SUFFIX",
    "TransferMode",
    "Negotiation",
    "head_slices",
    "negotiate",
    "source_ranks",
]

HEAD_MAJOR_SUFFIX = "|vllm-packed-kv"
"""Model-name suffix of vLLM's packed head-major pages (``kvbridge.connector.vllm.views``)."""


class TransferMode(enum.Enum):
    WHOLE_BLOCK = "whole_block"
    PER_SPAN = "per_span"
    REARRANGE = "rearrange"
    HEAD_SLICE = "head_slice"
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


def _mismatch(local: LayoutCore, remote: LayoutCore, *, tp: bool = True) -> str | None:
    lm, rm = local.model, remote.model
    pairs: list[tuple[str, object, object]] = [
        ("model.name", lm.name, rm.name),
        ("model.dtype", lm.dtype, rm.dtype),
        ("model.num_layers", lm.num_layers, rm.num_layers),
        ("model.num_kv_heads", lm.num_kv_heads, rm.num_kv_heads),
        ("model.head_size", lm.head_size, rm.head_size),
        ("block_size", local.block_size, remote.block_size),
        *([("tp_size", local.tp_size, remote.tp_size)] if tp else []),
        ("groups", [g.name for g in local.groups], [g.name for g in remote.groups]),
    ]
    for name, a, b in pairs:
        if a != b:
            return f"{name} differs: local {a!r}, remote {b!r}"
    for g in local.groups:  # each group's page shape (vLLM's hybrid groups may differ)
        mine, theirs = g.page, remote.group(g.name).page
        if mine != theirs:
            return (
                f"group {g.name!r} page shape differs: local {_page(local, g.name)}, "
                f"remote {_page(remote, g.name)}"
            )
    for a, b in zip(local.layers, remote.layers, strict=True):
        if a != b:
            return (
                f"layer differs: local {a.name!r} (group {a.group}, kv_source {a.kv_source}), "
                f"remote {b.name!r} (group {b.group}, kv_source {b.kv_source})"
            )
    return None


def _page(layout: LayoutCore, group: KVGroup) -> str:
    own = "" if layout.group(group).page is not None else " (the layout's own)"
    return layout.page(group).describe() + own


def negotiate(local: LayoutCore, remote: LayoutCore) -> Negotiation:
    """How ``local`` moves blocks to or from ``remote``; symmetric in the mode chosen."""
    reason = _mismatch(local, remote)
    if reason is not None:
        if local.tp_size != remote.tp_size and _mismatch(local, remote, tp=False) is None:
            why = _head_slice_refusal(local, remote)
            if why is None:
                return Negotiation(
                    TransferMode.HEAD_SLICE,
                    f"TP {local.tp_size} reads TP {remote.tp_size}: head slices of each page",
                )
            reason = f"{reason} ({why})"
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


def _head_slice_refusal(local: LayoutCore, remote: LayoutCore) -> str | None:
    """Why two layouts of different TP sizes cannot move head slices; None if they can."""
    small, big = sorted((local.tp_size, remote.tp_size))
    if big % small:
        return f"TP {big} is not a multiple of TP {small}"
    if local.model.num_kv_heads % big:
        return f"{local.model.num_kv_heads} KV heads do not split over TP {big}"
    for side in (local, remote):
        if not side.model.name.endswith(HEAD_MAJOR_SUFFIX):
            return f"a head slice of a {side.model.name!r} page is not one span"
        if side.order[2] != "KV":
            return f"a page of order {' '.join(side.order)} is not one span"
    if local.inner_order != remote.inner_order:
        return "inner orders differ"
    return None


def head_slices(local: LayoutCore, remote: LayoutCore) -> tuple[tuple[int, int], tuple[int, int]]:
    """Which slice of each side's page pairs with the other's under ``HEAD_SLICE``:
    ``((local part, local parts), (remote part, remote parts))``; a page is cut into
    ``parts`` equal spans (heads are contiguous per rank in vLLM, rank-major).

    With ``k = bigger TP / smaller TP``: a reader of TP rank ``r`` at the bigger size
    takes slice ``r % k`` of rank ``r // k``'s pages; a reader at the smaller size puts
    rank ``r * k + j``'s whole pages into its slice ``j``. Raises
    IncompatibleLayoutError for a rank that holds none of this side's heads.
    """
    negotiate(local, remote).raise_if_incompatible()
    if local.tp_size == remote.tp_size:
        if local.tp_rank != remote.tp_rank:
            raise IncompatibleLayoutError(
                f"TP rank {remote.tp_rank} holds other heads than TP rank {local.tp_rank}"
            )
        return (0, 1), (0, 1)
    if local.tp_size > remote.tp_size:
        k = local.tp_size // remote.tp_size
        if local.tp_rank // k != remote.tp_rank:
            raise IncompatibleLayoutError(
                f"TP rank {local.tp_rank} of {local.tp_size} takes its heads from rank "
                f"{local.tp_rank // k} of {remote.tp_size}, not rank {remote.tp_rank}"
            )
        return (0, 1), (local.tp_rank % k, k)
    k = remote.tp_size // local.tp_size
    if remote.tp_rank // k != local.tp_rank:
        raise IncompatibleLayoutError(
            f"TP rank {remote.tp_rank} of {remote.tp_size} holds none of the heads of rank "
            f"{local.tp_rank} of {local.tp_size}"
        )
    return (remote.tp_rank % k, k), (0, 1)


def source_ranks(local_rank: int, local_size: int, remote_size: int) -> list[int]:
    """The remote TP ranks whose heads a reader of ``local_rank`` of ``local_size`` needs
    (one for an equal or smaller remote TP size, ``k`` for a ``k`` times bigger one)."""
    if local_size >= remote_size:
        return [local_rank * remote_size // local_size]
    k = remote_size // local_size
    return [local_rank * k + j for j in range(k)]

"""``KVLayout``: what a worker's KV-cache memory is, in terms a peer can check.

Logical dimensions (docs/DESIGN-NOTES.md, "Layout and negotiation"): ``B`` blocks,
``L`` layers, ``KV`` (2), ``N`` tokens per block, ``H`` KV heads on this TP rank, ``C`` head size.
The *physical order* is a permutation of those six names, outermost first.
The first three positions hold ``B``, ``L`` and ``KV`` in any order and the
last three hold ``N``, ``H`` and ``C`` in any order (the *inner order*).

Memory of one KV-cache group is either one region (order not starting with
``L``; e.g. block-outermost ``B L KV N H C``) or one region per layer that
owns memory (order starting with ``L``; the classic layer-separate layout),
unless ``one_region`` says the layer-outermost group is one allocation with
its layers at the dense layer step (vLLM's ``LBHNC`` buffer): then it is one
region too (kind ``layer-outermost``). Every region is dense in the order.
A layer with a ``kv_source`` reuses another layer's KV, owns no memory and
is never counted, registered or moved.

The layout is frozen and msgpack-serialisable. Identity fields (model,
block size, groups, layers, TP size) must match for two peers to exchange
blocks; ``num_blocks``, the order, the TP rank and the registered regions are
per-worker facts. The parts (dims, order presets, the spec dataclasses)
live in :mod:`kvbridge.proto.specs` and are re-exported here; the fields, checks and
byte math in :mod:`kvbridge.proto.layout_core`; the wire form in
:mod:`kvbridge.proto.layout_wire`; negotiation in :mod:`kvbridge.proto.negotiate`.
Tensor construction lives in :mod:`kvbridge.proto.tensors` so that importing this
module never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvbridge.proto import codec
from kvbridge.proto.layout_core import LayoutCore
from kvbridge.proto.layout_wire import layout_from_bytes, layout_to_bytes
from kvbridge.proto.negotiate import Negotiation, negotiate
from kvbridge.proto.specs import (
    DIMS,
    DTYPE_BYTES,
    ORDERS,
    GroupSpec,
    KVGroup,
    LayerSpec,
    ModelSpec,
    PageShape,
    Region,
    Span,
    parse_group,
    parse_order,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DIMS",
    "DTYPE_BYTES",
    "ORDERS",
    "ModelSpec",
    "LayerSpec",
    "GroupSpec",
    "PageShape",
    "KVGroup",
    "Region",
    "Span",
    "KVLayout",
    "parse_group",
    "parse_order",
]


class KVLayout(LayoutCore):
    """The KV-cache layout descriptor passed to ``register_kv_caches``: a
    :class:`~kvbridge.proto.layout_core.LayoutCore` (fields, checks, byte math) that also
    negotiates with a peer's layout, goes on the wire and allocates or binds tensors."""

    __slots__ = ()

    def negotiate(self, remote: LayoutCore) -> Negotiation:
        """Transfer mode for reading/writing ``remote``'s blocks; see :mod:`negotiate`."""
        return negotiate(self, remote)

    def to_bytes(self) -> bytes:
        """This layout on the wire; see :mod:`kvbridge.proto.layout_wire`."""
        return layout_to_bytes(self)

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = codec.MAX_MESSAGE_BYTES) -> KVLayout:
        """Parse a peer's layout; raises WireError (bad bytes) or LayoutError (bad values)."""
        return layout_from_bytes(cls, data, max_bytes=max_bytes)

    # ----- tensors (torch imported lazily) ------------------------------------------------
    def allocate(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Allocate KV tensors for this layout; see :func:`kvbridge.proto.tensors.allocate`."""
        from kvbridge.proto.tensors import allocate

        return allocate(self, device)

    def bind(self, kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
        """This layout with ``regions`` read from tensors that match it exactly."""
        from kvbridge.proto.tensors import bind

        return bind(self, kv_caches)

    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        model_name: str,
        block_size: int,
        layer_groups: Mapping[str, str] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> KVLayout:
        """Describe tensors kvbridge did not allocate; see :mod:`kvbridge.proto.tensors`."""
        from kvbridge.proto.tensors import from_tensors

        return from_tensors(
            cls,
            kv_caches,
            model_name=model_name,
            block_size=block_size,
            layer_groups=layer_groups,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

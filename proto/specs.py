"""The parts a :class:`~kvbridge.proto.layout.KVLayout` is made of, and their checks.

Dimension names, dtypes and order presets; :class:`KVGroup` (which KV-cache group
a block belongs to); the frozen spec dataclasses (model, layer, group, region, span);
:func:`parse_order` and the checks that a set of groups and layers is consistent. Used by
:mod:`kvbridge.proto.layout` (which re-exports every public name here), by
:mod:`kvbridge.proto.tensors`,
:mod:`kvbridge.proto.presets` and the layout's wire form
(:mod:`kvbridge.proto.layout_wire`). Pure Python: no torch, no numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvbridge.proto.errors import LayoutError

__all__ = [
    "DIMS",
    "DTYPE_BYTES",
    "MAX_ATTENTION_GROUPS",
    "attention_group",
    "is_attention_group",
    "group_rank",
    "ORDERS",
    "GroupSpec",
    "KVGroup",
    "LayerSpec",
    "ModelSpec",
    "PageShape",
    "Region",
    "Span",
    "check_groups_and_layers",
    "check_order",
    "parse_group",
    "parse_order",
]

DIMS = ("B", "L", "KV", "N", "H", "C")
_OUTER = frozenset(("B", "L", "KV"))
_INNER = frozenset(("N", "H", "C"))

DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

ORDERS: Mapping[str, tuple[str, ...]] = {
    "block-nhd": ("B", "L", "KV", "N", "H", "C"),
    "block-hnd": ("B", "L", "KV", "H", "N", "C"),
    "layer-nhd": ("L", "B", "KV", "N", "H", "C"),
    "layer-hnd": ("L", "B", "KV", "H", "N", "C"),
    # vLLM's FlashAttention layout: per layer (2, num_blocks, block_size, H, C)
    "layer-kv-nhd": ("L", "KV", "B", "N", "H", "C"),
}


MAX_ATTENTION_GROUPS = 64
"""Attention groups beside ``self`` a layout may have (``g0`` .. ``g63``)."""


class KVGroup(StrEnum):
    """A KV-cache group: blocks with their own ids and names.

    ``SELF``: the decoder's self-attention (every model); ``CROSS``: cross-attention over
    an encoder input (encoder-decoder models); ``G0`` .. ``G63`` (values ``"g0"`` ..
    ``"g63"``, :func:`attention_group`): an engine's further self-attention groups (vLLM's
    hybrid KV cache manager: one group per attention kind, e.g. sliding window), each with
    its own block ids, named and moved like ``self``'s. A ``str`` enum: a member equals,
    hashes and encodes (msgpack, protobuf, JSON) exactly as its value, so the wire carries
    ``"self"``, ``"cross"`` and ``"g<i>"``; a string from a peer becomes a member only
    through :func:`parse_group`. ``repr`` is the value's, so messages read as before.
    """

    _ignore_ = ["i"]  # noqa: RUF012 - the enum's own directive
    SELF = "self"
    CROSS = "cross"
    for i in range(MAX_ATTENTION_GROUPS):
        vars()[f"G{i}"] = f"g{i}"

    def __repr__(self) -> str:
        return repr(self.value)


def parse_group(value: object, error: type[Exception] = LayoutError) -> KVGroup:
    """``value`` (a peer's or a config's group name) as a :class:`KVGroup`; ``error`` (a
    typed kvbridge error) naming the value and the known groups if it is none of them."""
    if isinstance(value, str):
        try:
            return KVGroup(value)
        except ValueError:
            pass
    shown = value[:64] if isinstance(value, str) else value
    raise error(
        f"unknown group {shown!r}; groups are 'self', 'cross' and "
        f"'g0'..'g{MAX_ATTENTION_GROUPS - 1}'"
    )


def attention_group(index: int) -> KVGroup:
    """The group of an engine's further self-attention KV cache group ``index`` (vLLM's
    group index): ``g<index>``."""
    if not 0 <= index < MAX_ATTENTION_GROUPS:
        raise LayoutError(f"KV cache group index {index} is outside 0..{MAX_ATTENTION_GROUPS - 1}")
    return KVGroup(f"g{index}")


def is_attention_group(name: str) -> bool:
    """Whether ``name`` is an :func:`attention_group`'s name."""
    return name not in (KVGroup.SELF, KVGroup.CROSS) and name in KVGroup._value2member_map_


def group_rank(name: str) -> tuple[int, int]:
    """Canonical group order: ``self``, the attention groups by index, ``cross``."""
    if name == KVGroup.SELF:
        return (0, 0)
    return (1, int(name[1:])) if is_attention_group(name) else (2, 0)


def parse_order(text: str | Sequence[str]) -> tuple[str, ...]:
    """Accept an order preset name (``block-nhd``) or dims (``"B L KV N H C"``)."""
    if isinstance(text, str):
        if text in ORDERS:
            return ORDERS[text]
        dims = tuple(text.replace(",", " ").split())
    else:
        dims = tuple(text)
    check_order(dims)
    return dims


def check_order(order: tuple[str, ...]) -> None:
    """Raise LayoutError unless ``order`` is six dims with ``N``, ``H``, ``C`` innermost."""
    if sorted(order) != sorted(DIMS):
        raise LayoutError(
            f"order {' '.join(order)!r} is not a permutation of {' '.join(DIMS)}; "
            f"use one of {', '.join(ORDERS)} or six dims"
        )
    if set(order[:3]) != _OUTER:
        raise LayoutError(
            f"order {' '.join(order)!r}: the innermost three dims must be N, H and C "
            "(in any order) so that each (layer, K/V) span of a block is contiguous"
        )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the KV bytes mean: two workers exchange blocks only if these agree."""

    name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for knob in ("num_layers", "num_kv_heads", "head_size"):
            if getattr(self, knob) < 1:
                raise LayoutError(f"ModelSpec.{knob} must be >= 1, got {getattr(self, knob)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One attention layer: its KV-cache group and, if it owns no memory, whose KV it reuses."""

    name: str
    group: KVGroup = KVGroup.SELF
    kv_source: str | None = None


@dataclass(frozen=True, slots=True)
class PageShape:
    """A group's page shape where it differs from its layout's (vLLM's hybrid groups of
    Gemma-4: a larger head size for full attention, larger blocks for sliding windows):
    block size in tokens, KV heads of the whole model (all TP ranks), head size."""

    block_size: int
    num_kv_heads: int
    head_size: int

    def __post_init__(self) -> None:
        for knob in ("block_size", "num_kv_heads", "head_size"):
            value = getattr(self, knob)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"PageShape.{knob} must be an integer >= 1, got {value!r}")

    def describe(self) -> str:
        return f"{self.block_size}-token blocks of {self.num_kv_heads} KV heads x {self.head_size}"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A KV-cache group with its own block ids: ``self`` or ``cross`` attention, or a
    further self-attention group (:func:`attention_group`). ``page``: the group's page
    shape where it differs from the layout's (None: the layout's block size and model)."""

    name: KVGroup
    num_blocks: int
    page: PageShape | None = None


@dataclass(frozen=True, slots=True)
class Region:
    """A registered memory region: a runtime fact, not part of compatibility."""

    addr: int
    length: int
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class Span:
    """``length`` bytes at ``offset`` inside region ``region`` of a layout."""

    region: int
    offset: int
    length: int


def check_groups_and_layers(
    num_layers: int, groups: Sequence[GroupSpec], layers: Sequence[LayerSpec]
) -> None:
    """Raise LayoutError unless ``groups`` and ``layers`` make one consistent layout.

    Groups: ``self`` first, then optionally ``cross``, each with >= 1 block.
    Layers: unique names in known groups, ``num_layers`` per group, a
    ``kv_source`` only to an earlier owning layer of the same group, and at
    least one owning layer in every group.
    """
    names = [g.name for g in groups]
    if (
        not names
        or names[0] != KVGroup.SELF
        or len(set(names)) != len(names)
        or names != sorted(names, key=group_rank)
    ):
        raise LayoutError(
            f"groups must be 'self' first, then attention groups g0..g63 in order, then "
            f"optionally 'cross'; got {names}"
        )
    for g in groups:
        parse_group(g.name)
        if g.num_blocks < 1:
            raise LayoutError(f"group {g.name!r} needs >= 1 block, got {g.num_blocks}")
    seen: dict[str, LayerSpec] = {}
    for layer in layers:
        if layer.name in seen:
            raise LayoutError(f"layer {layer.name!r} appears twice")
        if layer.group not in names:
            raise LayoutError(f"layer {layer.name!r} is in unknown group {layer.group!r}")
        src = layer.kv_source
        if src is not None:
            target = seen.get(src)
            if target is None or target.kv_source is not None:
                raise LayoutError(
                    f"layer {layer.name!r} shares KV of {src!r}, which must be an "
                    "earlier layer that owns its KV"
                )
            if target.group != layer.group:
                raise LayoutError(f"layer {layer.name!r} shares KV across groups")
        seen[layer.name] = layer
    if len(layers) != num_layers * len(groups):
        raise LayoutError(
            f"{len(layers)} layers listed, expected {num_layers} per group "
            f"for {len(groups)} group(s)"
        )
    for g in groups:
        if not any(x.group == g.name and x.kv_source is None for x in layers):
            raise LayoutError(f"group {g.name!r} has no layer that owns KV memory")

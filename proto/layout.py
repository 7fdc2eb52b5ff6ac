"""``KVLayout``: what a worker's KV-cache memory is, in terms a peer can check.

Logical dimensions (DESIGN.md §2): ``B`` blocks, ``L`` layers, ``KV`` (2),
``N`` tokens per block, ``H`` KV heads on this TP rank, ``C`` head size.
The *physical order* is a permutation of those six names, outermost first.
The first three positions hold ``B``, ``L`` and ``KV`` in any order and the
last three hold ``N``, ``H`` and ``C`` in any order (the *inner order*).

Memory of one KV-cache group is either one region (order not starting with
``L``; e.g. block-outermost ``B L KV N H C``) or one region per layer that
owns memory (order starting with ``L``; the classic layer-separate layout).
Every region is dense in the order. A layer with a ``kv_source`` reuses
another layer's KV, owns no memory and is never counted, registered or moved.

The layout is frozen and msgpack-serialisable. Identity fields (model,
block size, groups, layers, TP size) must match for two peers to exchange
blocks; ``num_blocks``, the order, the TP rank and the registered regions are
per-worker facts. Tensor construction lives in :mod:`kvbridge.proto.tensors`
so that importing this module never imports torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvbridge.proto import codec
from kvbridge.proto.errors import LayoutError, WireError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DIMS",
    "DTYPE_BYTES",
    "ORDERS",
    "ModelSpec",
    "LayerSpec",
    "GroupSpec",
    "Region",
    "Span",
    "KVLayout",
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

GROUP_KINDS = ("self", "cross")


def parse_order(text: str | Sequence[str]) -> tuple[str, ...]:
    """Accept an order preset name (``block-nhd``) or dims (``"B L KV N H C"``)."""
    if isinstance(text, str):
        if text in ORDERS:
            return ORDERS[text]
        dims = tuple(text.replace(",", " ").split())
    else:
        dims = tuple(text)
    _check_order(dims)
    return dims


def _check_order(order: tuple[str, ...]) -> None:
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
    group: str = "self"
    kv_source: str | None = None


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A KV-cache group with its own block ids: ``self`` or ``cross`` attention."""

    name: str
    num_blocks: int


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


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV-cache layout descriptor passed to ``register_kv_caches``."""

    model: ModelSpec
    block_size: int
    groups: tuple[GroupSpec, ...]
    layers: tuple[LayerSpec, ...]
    order: tuple[str, ...] = ORDERS["block-nhd"]
    tp_rank: int = 0
    tp_size: int = 1
    regions: tuple[Region, ...] = ()
    # Derived values (owning layers, fingerprint), filled on first use. ``__post_init__``
    # starts every instance with an empty cache, so a copy made by ``dataclasses.replace``
    # (which passes the original's ``_cache`` on) never reports the original's figures.
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", {})
        _check_order(self.order)
        if self.block_size < 1:
            raise LayoutError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.model.num_kv_heads % self.tp_size:
            raise LayoutError(
                f"{self.model.num_kv_heads} KV heads cannot be split over tp_size {self.tp_size}"
            )
        names = [g.name for g in self.groups]
        if not names or names[0] != "self" or len(set(names)) != len(names):
            raise LayoutError(f"groups must be 'self' first, then optionally 'cross'; got {names}")
        for g in self.groups:
            if g.name not in GROUP_KINDS:
                raise LayoutError(f"unknown group {g.name!r}; groups are {GROUP_KINDS}")
            if g.num_blocks < 1:
                raise LayoutError(f"group {g.name!r} needs >= 1 block, got {g.num_blocks}")
        seen: dict[str, LayerSpec] = {}
        for layer in self.layers:
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
        if len(self.layers) != self.model.num_layers * len(self.groups):
            raise LayoutError(
                f"{len(self.layers)} layers listed, expected {self.model.num_layers} per group "
                f"for {len(self.groups)} group(s)"
            )
        for g in self.groups:
            if not self.owning_layers(g.name):
                raise LayoutError(f"group {g.name!r} has no layer that owns KV memory")
        if self.regions and len(self.regions) != self.num_regions:
            raise LayoutError(f"{len(self.regions)} regions given, layout has {self.num_regions}")

    # ----- structure ---------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        """KV heads held by this TP rank (the ``H`` dimension)."""
        return self.model.num_kv_heads // self.tp_size

    @property
    def block_outermost(self) -> bool:
        return self.order[0] == "B"

    @property
    def layer_separate(self) -> bool:
        return self.order[0] == "L"

    @property
    def kind(self) -> str:
        """``block-outermost``, ``layer-separate`` or ``mixed`` (e.g. ``KV B L ...``)."""
        if self.block_outermost:
            return "block-outermost"
        return "layer-separate" if self.layer_separate else "mixed"

    @property
    def inner_order(self) -> tuple[str, ...]:
        return self.order[3:]

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise LayoutError(f"layout has no group {name!r}; it has {[g.name for g in self.groups]}")

    def owning_layers(self, group: str) -> tuple[LayerSpec, ...]:
        """Layers of ``group`` that own memory, in layout order (the ``L`` dimension)."""
        key = f"own:{group}"
        if key not in self._cache:
            self._cache[key] = tuple(
                x for x in self.layers if x.group == group and x.kv_source is None
            )
        result: tuple[LayerSpec, ...] = self._cache[key]
        return result

    def sizes(self, group: str) -> dict[str, int]:
        """Size of each logical dimension in ``group``."""
        return {
            "B": self.group(group).num_blocks,
            "L": len(self.owning_layers(group)),
            "KV": 2,
            "N": self.block_size,
            "H": self.num_heads,
            "C": self.model.head_size,
        }

    def strides(self, group: str) -> dict[str, int]:
        """Byte stride of each dimension in ``group`` (``L`` is the region step if per-layer)."""
        sizes = self.sizes(group)
        out: dict[str, int] = {}
        step = self.model.dtype_bytes
        for dim in reversed(self.order):
            out[dim] = step
            step *= sizes[dim]
        return out

    # ----- byte math ---------------------------------------------------------------------
    @property
    def span_bytes(self) -> int:
        """Bytes of one (layer, K/V) span of one block: ``N * H * C * dtype``."""
        return self.block_size * self.num_heads * self.model.head_size * self.model.dtype_bytes

    def block_bytes(self, group: str = "self") -> int:
        """Bytes of one block of ``group`` across all its owning layers and K/V."""
        return 2 * len(self.owning_layers(group)) * self.span_bytes

    def descriptors_per_block(self, group: str = "self") -> int:
        return 1 if self.block_outermost else 2 * len(self.owning_layers(group))

    def group_bytes(self, group: str) -> int:
        return self.group(group).num_blocks * self.block_bytes(group)

    @property
    def total_bytes(self) -> int:
        return sum(self.group_bytes(g.name) for g in self.groups)

    @property
    def num_regions(self) -> int:
        return sum(
            self.regions_of(g.name).stop - self.regions_of(g.name).start for g in self.groups
        )

    def regions_of(self, group: str) -> range:
        """Indices (into ``regions``) of the memory regions of ``group``."""
        start = 0
        for g in self.groups:
            count = len(self.owning_layers(g.name)) if self.layer_separate else 1
            if g.name == group:
                return range(start, start + count)
            start += count
        raise LayoutError(f"layout has no group {group!r}")

    def region_bytes(self, index: int) -> int:
        for g in self.groups:
            r = self.regions_of(g.name)
            if index in r:
                return self.group_bytes(g.name) // len(r)
        raise LayoutError(f"region index {index} out of range 0..{self.num_regions - 1}")

    def check_block_ids(self, group: str, block_ids: Sequence[int]) -> None:
        """Raise LayoutError naming the first id outside ``0..num_blocks-1`` of ``group``."""
        n = self.group(group).num_blocks
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
                raise LayoutError(f"block id {b!r} of group {group!r} is outside 0..{n - 1}")

    def block_spans(self, group: str, block_id: int) -> list[Span]:
        """The spans that together hold block ``block_id`` of ``group``.

        One span when block-outermost; otherwise one per (owning layer, K/V),
        layers in layout order, K before V. Both peers enumerate spans in the
        same canonical order, which is what makes ``PER_SPAN`` pairing work.
        """
        self.check_block_ids(group, [block_id])
        regions = self.regions_of(group)
        st = self.strides(group)
        if self.block_outermost:
            return [Span(regions.start, block_id * st["B"], st["B"])]
        n_layers = len(self.owning_layers(group))
        spans = []
        for li in range(n_layers):
            if self.layer_separate:
                region, base = regions.start + li, 0
            else:
                region, base = regions.start, li * st["L"]
            for kv in (0, 1):
                spans.append(
                    Span(region, base + block_id * st["B"] + kv * st["KV"], self.span_bytes)
                )
        return spans

    def iter_spans(self, group: str, block_ids: Sequence[int]) -> Iterator[Span]:
        for b in block_ids:
            yield from self.block_spans(group, b)

    # ----- identity, negotiation and wire ------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """The fields two peers must agree on to exchange blocks at all."""
        return {
            "model": _model_dict(self.model),
            "block_size": self.block_size,
            "groups": [g.name for g in self.groups],
            "layers": [[x.name, x.group, x.kv_source] for x in self.layers],
            "tp_size": self.tp_size,
        }

    def fingerprint(self) -> bytes:
        """SHA-256 over :meth:`identity`; roots block hashes so other models never match."""
        key = "fingerprint"
        if key not in self._cache:
            self._cache[key] = hashlib.sha256(codec.pack("KVIdentity", self.identity())).digest()
        fp: bytes = self._cache[key]
        return fp

    def negotiate(self, remote: KVLayout) -> Any:
        """Transfer mode for reading/writing ``remote``'s blocks; see :mod:`negotiate`."""
        from kvbridge.proto.negotiate import negotiate

        return negotiate(self, remote)

    def with_regions(self, regions: Sequence[Region]) -> KVLayout:
        return replace(self, regions=tuple(regions))

    def with_num_blocks(self, /, **num_blocks: int) -> KVLayout:
        """A copy with other block counts per group, e.g. ``with_num_blocks(self=128)``."""
        groups = tuple(GroupSpec(g.name, num_blocks.get(g.name, g.num_blocks)) for g in self.groups)
        return replace(self, groups=groups, regions=())

    def with_order(self, order: str | Sequence[str]) -> KVLayout:
        return replace(self, order=parse_order(order), regions=())

    def to_bytes(self) -> bytes:
        body = self.identity()
        body.update(
            num_blocks=[g.num_blocks for g in self.groups],
            order=list(self.order),
            tp_rank=self.tp_rank,
            regions=[[r.addr, r.length, r.device] for r in self.regions],
        )
        return codec.pack("KVLayout", body)

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int = codec.MAX_MESSAGE_BYTES) -> KVLayout:
        """Parse a peer's layout; raises WireError (bad bytes) or LayoutError (bad values)."""
        body = codec.unpack(data, "KVLayout", max_bytes=max_bytes)
        try:
            m = codec.take(body, "model", dict)
            model = ModelSpec(
                name=codec.take(m, "name", str),
                dtype=codec.take(m, "dtype", str),
                num_layers=codec.take(m, "num_layers", int),
                num_kv_heads=codec.take(m, "num_kv_heads", int),
                head_size=codec.take(m, "head_size", int),
            )
            names = codec.take(body, "groups", list)
            counts = codec.take(body, "num_blocks", list)
            if len(names) != len(counts):
                raise WireError("groups and num_blocks differ in length")
            groups = tuple(GroupSpec(_str(n), _int(c)) for n, c in zip(names, counts, strict=True))
            layers = []
            for item in codec.take(body, "layers", list):
                if not isinstance(item, list) or len(item) != 3:
                    raise WireError("each layer must be [name, group, kv_source]")
                src = item[2]
                layers.append(
                    LayerSpec(_str(item[0]), _str(item[1]), None if src is None else _str(src))
                )
            regions = []
            for item in codec.take(body, "regions", list):
                if not isinstance(item, list) or len(item) != 3:
                    raise WireError("each region must be [addr, length, device]")
                regions.append(Region(_int(item[0]), _int(item[1]), _str(item[2])))
            return cls(
                model=model,
                block_size=codec.take(body, "block_size", int),
                groups=groups,
                layers=tuple(layers),
                order=tuple(_str(d) for d in codec.take(body, "order", list)),
                tp_rank=codec.take(body, "tp_rank", int),
                tp_size=codec.take(body, "tp_size", int),
                regions=tuple(regions),
            )
        except TypeError as exc:
            raise WireError(f"KVLayout: {exc}") from None

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
            kv_caches,
            model_name=model_name,
            block_size=block_size,
            layer_groups=layer_groups,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    def describe(self) -> str:
        """Human-readable byte math, as printed by ``kvbridge layout``."""
        lines = [
            f"model {self.model.name}: {self.model.num_layers} layers x {self.model.num_kv_heads} "
            f"KV heads x {self.model.head_size} head size, {self.model.dtype}, "
            f"block_size {self.block_size}, tp {self.tp_rank}/{self.tp_size}",
            f"order {' '.join(self.order)} ({self.kind})",
        ]
        for g in self.groups:
            own = len(self.owning_layers(g.name))
            shared = sum(1 for x in self.layers if x.group == g.name) - own
            lines.append(
                f"  group {g.name}: {g.num_blocks} blocks, {own} owning layers"
                + (f" (+{shared} sharing KV, never moved)" if shared else "")
                + f", block {_human(self.block_bytes(g.name))}"
                f" = {self.descriptors_per_block(g.name)} descriptor(s) of "
                f"{_human(self.block_bytes(g.name) // self.descriptors_per_block(g.name))},"
                f" total {_human(self.group_bytes(g.name))}"
            )
        return "\n".join(lines)


def _model_dict(m: ModelSpec) -> dict[str, Any]:
    return {
        "name": m.name,
        "dtype": m.dtype,
        "num_layers": m.num_layers,
        "num_kv_heads": m.num_kv_heads,
        "head_size": m.head_size,
    }


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise WireError(f"expected a string, got {type(v).__name__}")
    return v


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(f"expected an integer, got {type(v).__name__}")
    return v


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")

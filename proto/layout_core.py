"""The core of a KV-cache layout: its fields, their checks and its byte math.

:class:`LayoutCore` is :class:`~kvbridge.proto.layout.KVLayout` without the methods that
reach other modules (the wire form, negotiation, tensors). Those modules
(:mod:`kvbridge.proto.layout_wire`, :mod:`kvbridge.proto.negotiate`,
:mod:`kvbridge.proto.tensors`) take a ``LayoutCore``, and ``KVLayout`` adds the methods
that call them, so imports point one way: ``layout -> wire, negotiate, tensors -> core``.
Code outside ``kvbridge.proto`` uses ``KVLayout``; see :mod:`kvbridge.proto.layout` for
what a layout means.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Self

from kvbridge.proto import codec
from kvbridge.proto.errors import LayoutError
from kvbridge.proto.specs import (
    ORDERS,
    GroupSpec,
    KVGroup,
    LayerSpec,
    ModelSpec,
    PageShape,
    Region,
    Span,
    check_groups_and_layers,
    check_order,
    parse_order,
)

__all__ = ["LayoutCore", "model_dict"]


def model_dict(m: ModelSpec) -> dict[str, Any]:
    """``m`` as the plain dict that identity, fingerprint and wire form use."""
    return {
        "name": m.name,
        "dtype": m.dtype,
        "num_layers": m.num_layers,
        "num_kv_heads": m.num_kv_heads,
        "head_size": m.head_size,
    }


@dataclass(frozen=True, slots=True)
class LayoutCore:
    """A KV-cache layout's fields, checks and byte math: :class:`~kvbridge.proto.layout.KVLayout`
    without the parts that reach the wire form, negotiation and tensors."""

    model: ModelSpec
    block_size: int
    groups: tuple[GroupSpec, ...]
    layers: tuple[LayerSpec, ...]
    order: tuple[str, ...] = ORDERS["block-nhd"]
    tp_rank: int = 0
    tp_size: int = 1
    regions: tuple[Region, ...] = ()
    one_region: bool = False
    """Layer-outermost orders only: all owning layers of a group lie in one allocation at
    the dense layer step and are registered as one region (a per-worker fact, like the
    order); False means one region per owning layer."""
    # Derived values (owning layers, fingerprint), filled on first use. ``__post_init__``
    # starts every instance with an empty cache, so a copy made by ``dataclasses.replace``
    # (which passes the original's ``_cache`` on) never reports the original's figures.
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", {})
        check_order(self.order)
        if self.block_size < 1:
            raise LayoutError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            ranks = f" (ranks are 0 to {self.tp_size - 1})" if self.tp_size > 0 else ""
            raise LayoutError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}{ranks}")
        if self.model.num_kv_heads % self.tp_size:
            heads = self.model.num_kv_heads
            sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
            raise LayoutError(
                f"{heads} KV heads cannot be split over tp_size {self.tp_size}; "
                f"use a TP size that divides {heads}: {sizes}"
            )
        check_groups_and_layers(self.model.num_layers, self.groups, self.layers)
        for g in self.groups:
            self._check_page(g.name, g.page)
        if self.one_region and self.order[0] != "L":
            raise LayoutError(
                f"one_region applies to layer-outermost orders only, got {' '.join(self.order)}"
            )
        if self.regions and len(self.regions) != self.num_regions:
            raise LayoutError(f"{len(self.regions)} regions given, layout has {self.num_regions}")

    def _check_page(self, group: KVGroup, page: PageShape | None) -> None:
        if page is None:
            return
        if group == KVGroup.SELF:
            raise LayoutError(
                "group 'self' has the layout's own page shape (block_size and model); "
                "give a page shape only to a further group"
            )
        if page == self.own_page:
            raise LayoutError(
                f"group {group!r} is given the layout's own page shape ({page.describe()}); "
                "give None instead"
            )
        if page.num_kv_heads % self.tp_size:
            raise LayoutError(
                f"group {group!r}: {page.num_kv_heads} KV heads cannot be split over tp_size "
                f"{self.tp_size}; use a TP size that divides {page.num_kv_heads}"
            )

    # ----- structure ---------------------------------------------------------------------
    @property
    def own_page(self) -> PageShape:
        """The layout's own page shape (``self``'s, and any group's without one)."""
        return PageShape(self.block_size, self.model.num_kv_heads, self.model.head_size)

    def page(self, group: KVGroup) -> PageShape:
        """The page shape of ``group``: its own where it has one, else the layout's."""
        key = f"page:{group}"
        if key not in self._cache:
            self._cache[key] = self.group(group).page or self.own_page
        page: PageShape = self._cache[key]
        return page

    @property
    def uniform_pages(self) -> bool:
        """Every group has the layout's page shape (no group gives one of its own)."""
        return all(g.page is None for g in self.groups)

    @property
    def num_heads(self) -> int:
        """KV heads held by this TP rank (the ``H`` dimension)."""
        return self.model.num_kv_heads // self.tp_size

    @property
    def block_outermost(self) -> bool:
        return self.order[0] == "B"

    @property
    def layer_separate(self) -> bool:
        """One region per owning layer (layer-outermost and not ``one_region``)."""
        return self.order[0] == "L" and not self.one_region

    @property
    def kind(self) -> str:
        """``block-outermost``, ``layer-separate``, ``layer-outermost`` (one region) or
        ``mixed`` (e.g. ``KV B L ...``)."""
        if self.block_outermost:
            return "block-outermost"
        if self.order[0] == "L":
            return "layer-outermost" if self.one_region else "layer-separate"
        return "mixed"

    @property
    def inner_order(self) -> tuple[str, ...]:
        return self.order[3:]

    def group(self, name: KVGroup) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise LayoutError(f"layout has no group {name!r}; it has {[g.name for g in self.groups]}")

    def owning_layers(self, group: KVGroup) -> tuple[LayerSpec, ...]:
        """Layers of ``group`` that own memory, in layout order (the ``L`` dimension)."""
        key = f"own:{group}"
        if key not in self._cache:
            self._cache[key] = tuple(
                x for x in self.layers if x.group == group and x.kv_source is None
            )
        result: tuple[LayerSpec, ...] = self._cache[key]
        return result

    def sizes(self, group: KVGroup) -> dict[str, int]:
        """Size of each logical dimension in ``group`` (its own page shape, if any)."""
        page = self.page(group)
        return {
            "B": self.group(group).num_blocks,
            "L": len(self.owning_layers(group)),
            "KV": 2,
            "N": page.block_size,
            "H": page.num_kv_heads // self.tp_size,
            "C": page.head_size,
        }

    def strides(self, group: KVGroup) -> dict[str, int]:
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
        """Bytes of one (layer, K/V) span of one block of ``self`` (of every group unless
        :attr:`uniform_pages` is False): ``N * H * C * dtype``."""
        return self.block_size * self.num_heads * self.model.head_size * self.model.dtype_bytes

    def group_span_bytes(self, group: KVGroup) -> int:
        """Bytes of one (layer, K/V) span of one block of ``group``, in its page shape."""
        sizes = self.sizes(group)
        return sizes["N"] * sizes["H"] * sizes["C"] * self.model.dtype_bytes

    def block_bytes(self, group: KVGroup = KVGroup.SELF) -> int:
        """Bytes of one block of ``group`` across all its owning layers and K/V."""
        return 2 * len(self.owning_layers(group)) * self.group_span_bytes(group)

    def descriptors_per_block(self, group: KVGroup = KVGroup.SELF) -> int:
        return 1 if self.block_outermost else 2 * len(self.owning_layers(group))

    def group_bytes(self, group: KVGroup) -> int:
        return self.group(group).num_blocks * self.block_bytes(group)

    @property
    def total_bytes(self) -> int:
        return sum(self.group_bytes(g.name) for g in self.groups)

    @property
    def num_regions(self) -> int:
        return sum(
            self.regions_of(g.name).stop - self.regions_of(g.name).start for g in self.groups
        )

    def regions_of(self, group: KVGroup) -> range:
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

    def check_block_ids(self, group: KVGroup, block_ids: Sequence[int]) -> None:
        """Raise LayoutError naming the first id outside ``0..num_blocks-1`` of ``group``."""
        n = self.group(group).num_blocks
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
                raise LayoutError(f"block id {b!r} of group {group!r} is outside 0..{n - 1}")

    def block_spans(self, group: KVGroup, block_id: int) -> list[Span]:
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
        span = self.group_span_bytes(group)
        spans = []
        for li in range(n_layers):
            if self.layer_separate:
                region, base = regions.start + li, 0
            else:
                region, base = regions.start, li * st["L"]
            for kv in (0, 1):
                spans.append(Span(region, base + block_id * st["B"] + kv * st["KV"], span))
        return spans

    def iter_spans(self, group: KVGroup, block_ids: Sequence[int]) -> Iterator[Span]:
        for b in block_ids:
            yield from self.block_spans(group, b)

    # ----- identity ---------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """The fields two peers must agree on to exchange blocks at all. ``pages`` (each
        group's own page shape) only where a group has one: a layout of uniform pages keeps
        the identity, fingerprint and block names it always had."""
        out: dict[str, Any] = {
            "model": model_dict(self.model),
            "block_size": self.block_size,
            "groups": [g.name for g in self.groups],
            "layers": [[x.name, x.group, x.kv_source] for x in self.layers],
            "tp_size": self.tp_size,
        }
        if not self.uniform_pages:
            out["pages"] = {
                str(g.name): [g.page.block_size, g.page.num_kv_heads, g.page.head_size]
                for g in self.groups
                if g.page is not None
            }
        return out

    def fingerprint(self) -> bytes:
        """SHA-256 over :meth:`identity`; roots block hashes so other models never match."""
        key = "fingerprint"
        if key not in self._cache:
            self._cache[key] = hashlib.sha256(codec.pack("KVIdentity", self.identity())).digest()
        fp: bytes = self._cache[key]
        return fp

    def with_regions(self, regions: Sequence[Region]) -> Self:
        return replace(self, regions=tuple(regions))

    def with_num_blocks(self, /, **num_blocks: int) -> Self:
        """A copy with other block counts per group, e.g. ``with_num_blocks(self=128)``."""
        groups = tuple(
            replace(g, num_blocks=num_blocks.get(g.name, g.num_blocks)) for g in self.groups
        )
        return replace(self, groups=groups, regions=())

    def with_order(self, order: str | Sequence[str], *, one_region: bool = False) -> Self:
        return replace(self, order=parse_order(order), regions=(), one_region=one_region)

    def describe(self) -> str:
        """Human-readable byte math, as printed by ``kvbridge layout``."""
        lines = [
            f"model {self.model.name}: {self.model.num_layers} layers x {self.model.num_kv_heads} "
            f"KV heads x {self.model.head_size} head size, {self.model.dtype}, "
            f"block_size {self.block_size}, tp {self.tp_rank}/{self.tp_size}",
            f"order {' '.join(self.order)} ({self.kind}, {self.num_regions} region(s))",
        ]
        for g in self.groups:
            own = len(self.owning_layers(g.name))
            shared = sum(1 for x in self.layers if x.group == g.name) - own
            lines.append(
                f"  group {g.name}: {g.num_blocks} blocks, {own} owning layers"
                + (f" (+{shared} sharing KV, never moved)" if shared else "")
                + (f", pages of {g.page.describe()}" if g.page is not None else "")
                + f", block {_human(self.block_bytes(g.name))}"
                f" = {self.descriptors_per_block(g.name)} descriptor(s) of "
                f"{_human(self.block_bytes(g.name) // self.descriptors_per_block(g.name))},"
                f" total {_human(self.group_bytes(g.name))}"
            )
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")

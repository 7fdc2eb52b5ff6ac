"""A :class:`~kvbridge.proto.layout.KVLayout` on the wire: msgpack bytes and back.

Peers send their bound layout in the handshake (``layout.to_bytes()``) and
parse the other side's with ``KVLayout.from_bytes``; both methods delegate
here. The body is the layout's identity (:meth:`KVLayout.identity`) plus its
per-worker facts (block counts, order, TP rank, regions, one_region), in a
:mod:`kvbridge.proto.codec` envelope named ``KVLayout``. Decoding is
size-limited and type-checked field by field: bad bytes raise WireError, bad
values the layout's own LayoutError.
"""

from __future__ import annotations

from typing import TypeVar

from kvbridge.proto import codec
from kvbridge.proto.errors import WireError
from kvbridge.proto.layout_core import LayoutCore
from kvbridge.proto.specs import GroupSpec, LayerSpec, ModelSpec, PageShape, Region, parse_group

__all__ = ["layout_from_bytes", "layout_to_bytes"]

L = TypeVar("L", bound=LayoutCore)


def layout_to_bytes(layout: LayoutCore) -> bytes:
    body = layout.identity()
    body.update(
        num_blocks=[g.num_blocks for g in layout.groups],
        order=list(layout.order),
        tp_rank=layout.tp_rank,
        regions=[[r.addr, r.length, r.device] for r in layout.regions],
        one_region=layout.one_region,
    )
    return codec.pack("KVLayout", body)


def layout_from_bytes(cls: type[L], data: bytes, *, max_bytes: int = codec.MAX_MESSAGE_BYTES) -> L:
    """Parse a peer's layout into ``cls``; raises WireError (bad bytes) or LayoutError."""
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
        pages = _pages(body.get("pages", {}), names)
        groups = tuple(
            GroupSpec(parse_group(_str(n)), _int(c), pages.get(n))
            for n, c in zip(names, counts, strict=True)
        )
        layers = []
        for item in codec.take(body, "layers", list):
            if not isinstance(item, list) or len(item) != 3:
                raise WireError("each layer must be [name, group, kv_source]")
            src = item[2]
            layers.append(
                LayerSpec(
                    _str(item[0]), parse_group(_str(item[1])), None if src is None else _str(src)
                )
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
            one_region=_bool(body.get("one_region", False)),
        )
    except TypeError as exc:
        raise WireError(f"KVLayout: {exc}") from None


def _pages(raw: object, names: list[object]) -> dict[object, PageShape]:
    """The ``pages`` field: each group's own page shape, ``{group: [block size, KV heads,
    head size]}``, for groups of ``names`` only."""
    if not isinstance(raw, dict):
        raise WireError(f"pages must be a map, got {type(raw).__name__}")
    out = {}
    for name, shape in raw.items():
        if name not in names:
            raise WireError(f"pages names group {name!r}, which the layout does not have")
        if not isinstance(shape, list) or len(shape) != 3:
            raise WireError("each page shape must be [block_size, num_kv_heads, head_size]")
        out[name] = PageShape(_int(shape[0]), _int(shape[1]), _int(shape[2]))
    return out


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise WireError(f"expected a string, got {type(v).__name__}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise WireError(f"expected a boolean, got {type(v).__name__}")
    return v


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(f"expected an integer, got {type(v).__name__}")
    return v

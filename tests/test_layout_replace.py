"""KVLayout: a copy made with ``dataclasses.replace`` reports its own derived figures.

``KVLayout`` caches derived values (owning layers, fingerprint). A copy must
never inherit them from the original, or it reports stale per-block bytes and
a stale fingerprint while comparing equal to a freshly built layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvbridge.proto import PRESETS, KVLayout, LayerSpec, make_layout, parse_order


def figures(lay: KVLayout) -> dict[str, Any]:
    """Every derived figure a peer or the transport relies on."""
    out: dict[str, Any] = {
        "fingerprint": lay.fingerprint(),
        "identity": lay.identity(),
        "span_bytes": lay.span_bytes,
        "total_bytes": lay.total_bytes,
        "num_regions": lay.num_regions,
        "kind": lay.kind,
        "to_bytes": lay.to_bytes(),
    }
    for g in lay.groups:
        out[g.name] = {
            "owning": lay.owning_layers(g.name),
            "sizes": lay.sizes(g.name),
            "strides": lay.strides(g.name),
            "block_bytes": lay.block_bytes(g.name),
            "descriptors": lay.descriptors_per_block(g.name),
            "group_bytes": lay.group_bytes(g.name),
            "regions": lay.regions_of(g.name),
            "spans": lay.block_spans(g.name, g.num_blocks - 1),
        }
    return out


def warmed(lay: KVLayout) -> KVLayout:
    """``lay`` after every cached value has been computed once."""
    figures(lay)
    return lay


def base(**kw: Any) -> KVLayout:
    args: dict[str, Any] = {"block_size": 16, "num_blocks": 8, "order": "block-nhd"}
    args.update(kw)
    return make_layout(PRESETS["kv-share-third"], **args)


@pytest.mark.parametrize(
    ("change", "fresh_kwargs"),
    [
        ({"block_size": 32}, {"block_size": 32}),
        ({"order": parse_order("layer-nhd")}, {"order": "layer-nhd"}),
        ({"order": parse_order("block-hnd")}, {"order": "block-hnd"}),
    ],
    ids=["block_size", "order-layer", "order-hnd"],
)
def test_replaced_layout_reports_the_figures_of_a_fresh_layout(
    change: dict[str, Any], fresh_kwargs: dict[str, Any]
) -> None:
    copy = dataclasses.replace(warmed(base()), **change)
    fresh = base(**fresh_kwargs)
    assert copy == fresh
    assert figures(copy) == figures(fresh)


def test_replaced_num_blocks_reports_the_figures_of_a_fresh_layout() -> None:
    orig = warmed(base())
    groups = tuple(dataclasses.replace(g, num_blocks=32) for g in orig.groups)
    copy = dataclasses.replace(orig, groups=groups)
    fresh = base(num_blocks=32)
    assert copy == fresh
    assert figures(copy) == figures(fresh)


def test_replaced_layers_report_their_own_owning_layers_and_block_bytes() -> None:
    orig = warmed(base())
    # every layer owns its KV in the copy: more owning layers, bigger blocks
    layers = tuple(LayerSpec(x.name, x.group) for x in orig.layers)
    copy = dataclasses.replace(orig, layers=layers)
    fresh = KVLayout(orig.model, orig.block_size, orig.groups, layers, orig.order)
    assert figures(copy) == figures(fresh)
    assert copy.block_bytes() > orig.block_bytes()
    assert copy.fingerprint() != orig.fingerprint()


def test_original_is_not_changed_by_figures_computed_on_its_copy() -> None:
    orig = base()
    copy = dataclasses.replace(orig, block_size=32)
    warmed(copy)
    assert figures(orig) == figures(base())

"""KVLayout: byte math, tensors, wire format and negotiation."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.proto import (
    ORDERS,
    IncompatibleLayoutError,
    KVLayout,
    LayoutError,
    TransferMode,
    VersionMismatchError,
    WireError,
    codec,
    make_layout,
    preset_layout,
)
from kvbridge.proto.presets import PRESETS, PresetShape

ALL_ORDERS = [
    tuple(o) + tuple(i)
    for o in itertools.permutations(("B", "L", "KV"))
    for i in itertools.permutations(("N", "H", "C"))
]
SMALL_PRESETS = ["tiny", "encdec-small", "kv-share-third", "kv-share-every2"]


def small(preset: str, order: tuple[str, ...] | str = "block-nhd", blocks: int = 3) -> KVLayout:
    shape = PRESETS[preset]
    # keep tensors small: fewer heads/channels, same layer and sharing structure
    shrunk = PresetShape(
        shape.name,
        shape.num_layers,
        2,
        8,
        shape.dtype,
        shape.encoder_decoder,
        shape.share_last,
        shape.share_every,
    )
    return make_layout(shrunk, block_size=4, num_blocks=blocks, order=order)


def test_llama3_8b_block_is_two_mib_in_one_descriptor_when_block_outermost() -> None:
    lay = preset_layout("llama3-8b", order="block-nhd")
    assert lay.block_bytes() == 32 * 2 * 16 * 8 * 128 * 2 == 2 * 1024 * 1024
    assert lay.descriptors_per_block() == 1
    sep = preset_layout("llama3-8b", order="layer-nhd")
    assert sep.block_bytes() == lay.block_bytes()
    assert sep.descriptors_per_block() == 64
    assert sep.span_bytes == 32 * 1024


def test_kv_sharing_layers_own_no_bytes() -> None:
    plain = make_layout(PresetShape("m", 24, 8, 128, "bfloat16"))
    shared = preset_layout("kv-share-third")
    assert len(shared.owning_layers("self")) == 16
    assert shared.block_bytes() * 24 == plain.block_bytes() * 16


@pytest.mark.parametrize("preset", SMALL_PRESETS)
@pytest.mark.parametrize("order", ALL_ORDERS, ids=lambda o: "".join(o))
def test_spans_of_every_block_tile_the_allocation_exactly(
    preset: str, order: tuple[str, ...]
) -> None:
    lay = small(preset, order)
    for g in lay.groups:
        covered: dict[int, list[tuple[int, int]]] = {}
        for b in range(g.num_blocks):
            spans = lay.block_spans(g.name, b)
            assert len(spans) == lay.descriptors_per_block(g.name)
            assert sum(s.length for s in spans) == lay.block_bytes(g.name)
            for s in spans:
                covered.setdefault(s.region, []).append((s.offset, s.offset + s.length))
        assert set(covered) == set(lay.regions_of(g.name))
        for region, intervals in covered.items():
            intervals.sort()
            assert intervals[0][0] == 0
            for (_, end), (start, _) in itertools.pairwise(intervals):
                assert end == start, "spans overlap or leave a gap"
            assert intervals[-1][1] == lay.region_bytes(region)


@pytest.mark.parametrize("preset", SMALL_PRESETS)
@pytest.mark.parametrize("order", ALL_ORDERS, ids=lambda o: "".join(o))
def test_from_tensors_recovers_the_layout_that_allocated_them(
    preset: str, order: tuple[str, ...]
) -> None:
    lay = small(preset, order)
    caches = lay.allocate()
    described = KVLayout.from_tensors(
        caches,
        model_name=lay.model.name,
        block_size=lay.block_size,
        layer_groups={x.name: x.group for x in lay.layers},
    )
    assert described.identity() == lay.identity()
    assert described.order == lay.order
    assert described.with_regions(()) == lay
    assert lay.bind(caches) == described


@pytest.mark.parametrize("order", ["block-nhd", "block-hnd", "layer-nhd", "layer-kv-nhd"])
def test_spans_address_the_bytes_of_exactly_that_block(order: str) -> None:
    shape = PresetShape("m", 6, 2, 8, "float32", share_last=2)
    lay = make_layout(shape, block_size=4, num_blocks=4, order=order)
    caches = lay.allocate()
    bound = lay.bind(caches)
    owners = lay.owning_layers("self")
    for i, layer in enumerate(owners):
        for b in range(4):
            caches[layer.name][:, b] = float(100 * i + b + 1)
    # a layer-separate layout is one allocation per layer: read each region's own storage
    storages = {caches[x.name].data_ptr(): caches[x.name].untyped_storage() for x in owners}
    for b in range(4):
        layers_seen = set()
        for s in bound.block_spans("self", b):
            region = bound.regions[s.region]
            storage = storages[region.addr] if bound.layer_separate else storages[min(storages)]
            flat = torch.tensor([], dtype=torch.float32).set_(storage)
            start = (region.addr + s.offset - storage.data_ptr()) // 4
            values = {int(v) for v in flat[start : start + s.length // 4].tolist()}
            assert {v % 100 for v in values} == {b + 1}
            layers_seen |= {v // 100 for v in values}
        assert layers_seen == set(range(len(owners)))


def test_kv_sharing_layer_gets_its_sources_tensor() -> None:
    lay = small("kv-share-every2")
    caches = lay.allocate()
    for layer in lay.layers:
        if layer.kv_source:
            assert caches[layer.name] is caches[layer.kv_source]


def test_from_tensors_rejects_wrong_shape_with_a_clear_error() -> None:
    with pytest.raises(LayoutError, match=r"expected shape \(2, num_blocks, 16"):
        KVLayout.from_tensors({"l0": torch.zeros(2, 4, 8, 2, 8)}, model_name="m", block_size=16)


def test_from_tensors_rejects_padded_strides() -> None:
    buf = torch.zeros(2, 4, 4, 2, 16)[..., :8]  # padded head dim
    with pytest.raises(LayoutError, match="not dense"):
        KVLayout.from_tensors(
            {"l0": buf, "l1": torch.zeros(2, 4, 4, 2, 8)}, model_name="m", block_size=4
        )


@given(
    preset=st.sampled_from(SMALL_PRESETS),
    order=st.sampled_from(ALL_ORDERS),
    blocks=st.integers(1, 50),
    block_size=st.sampled_from([1, 16, 64]),
    tp=st.sampled_from([1, 2]),
    addr=st.integers(0, 2**48),
)
@settings(max_examples=60, deadline=None)
def test_layout_round_trips_through_msgpack(
    preset: str, order: tuple[str, ...], blocks: int, block_size: int, tp: int, addr: int
) -> None:
    lay = make_layout(
        PRESETS[preset],
        block_size=block_size,
        num_blocks=blocks,
        order=order,
        tp_rank=tp - 1,
        tp_size=tp,
    )
    from kvbridge.proto import Region

    lay = lay.with_regions(
        [Region(addr + i, lay.region_bytes(i), "cpu") for i in range(lay.num_regions)]
    )
    again = KVLayout.from_bytes(lay.to_bytes())
    assert again == lay
    assert again.fingerprint() == lay.fingerprint()


def test_unknown_schema_version_is_rejected_naming_both_versions() -> None:
    import msgpack

    data = msgpack.packb({"v": 99, "kind": "KVLayout", "body": {}})
    with pytest.raises(VersionMismatchError, match=r"version 99.*version 1"):
        KVLayout.from_bytes(data)


def test_oversize_and_garbage_layout_bytes_are_rejected() -> None:
    lay = preset_layout("tiny")
    with pytest.raises(WireError, match="exceeds"):
        KVLayout.from_bytes(lay.to_bytes(), max_bytes=10)
    with pytest.raises(WireError):
        KVLayout.from_bytes(b"\xc1garbage")
    body = codec.unpack(lay.to_bytes(), "KVLayout")
    body["block_size"] = "16"
    with pytest.raises(WireError, match="block_size"):
        KVLayout.from_bytes(codec.pack("KVLayout", body))
    body["block_size"] = -1
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout.from_bytes(codec.pack("KVLayout", body))


@given(st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_random_bytes_never_crash_the_layout_parser(data: bytes) -> None:
    with contextlib.suppress(WireError, LayoutError):
        KVLayout.from_bytes(data)


def test_negotiation_outcomes() -> None:
    base = preset_layout("tiny", order="block-nhd")
    assert base.negotiate(preset_layout("tiny", order="block-nhd", num_blocks=999)).mode is (
        TransferMode.WHOLE_BLOCK
    )
    assert base.negotiate(preset_layout("tiny", order="layer-nhd")).mode is TransferMode.PER_SPAN
    assert (
        preset_layout("tiny", order="layer-nhd")
        .negotiate(preset_layout("tiny", order="layer-kv-nhd"))
        .mode
        is TransferMode.PER_SPAN
    )
    assert base.negotiate(preset_layout("tiny", order="block-hnd")).mode is TransferMode.REARRANGE
    bad = base.negotiate(preset_layout("tiny", block_size=32))
    assert bad.mode is TransferMode.INCOMPATIBLE
    assert "block_size" in bad.reason and "16" in bad.reason and "32" in bad.reason
    with pytest.raises(IncompatibleLayoutError, match="block_size differs: local 16, remote 32"):
        bad.raise_if_incompatible()
    other = base.negotiate(preset_layout("small"))
    assert other.mode is TransferMode.INCOMPATIBLE and "model.name" in other.reason
    tp = base.negotiate(preset_layout("tiny", tp_size=2))
    assert "tp_size" in tp.reason


def test_kv_sharing_pattern_mismatch_is_incompatible() -> None:
    a = make_layout(PresetShape("m", 6, 2, 8, "float32", share_last=2))
    b = make_layout(PresetShape("m", 6, 2, 8, "float32", share_every=2))
    result = a.negotiate(b)
    assert result.mode is TransferMode.INCOMPATIBLE and "layer differs" in result.reason


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"order": "B L KV N H X"}, "not a permutation"),
        ({"order": "N H C B L KV"}, "innermost three"),
        ({"block_size": 0}, "block_size"),
        ({"tp_size": 3}, "cannot be split"),
        ({"num_blocks": 0}, "needs >= 1 block"),
    ],
)
def test_invalid_layouts_name_the_bad_knob(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        preset_layout("tiny", **kwargs)


def test_out_of_range_block_ids_are_rejected() -> None:
    lay = preset_layout("tiny", num_blocks=4)
    with pytest.raises(LayoutError, match=r"block id 4 .* outside 0\.\.3"):
        lay.block_spans("self", 4)
    with pytest.raises(LayoutError, match="outside"):
        lay.check_block_ids("self", [0, -1])
    with pytest.raises(LayoutError, match="no group 'cross'"):
        lay.block_spans("cross", 0)


def test_every_named_order_is_supported() -> None:
    for name in ORDERS:
        assert preset_layout("tiny", order=name).order == ORDERS[name]

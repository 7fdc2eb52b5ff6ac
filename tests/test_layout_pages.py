"""KVLayout groups of their own page shape (vLLM's hybrid groups of Gemma-4: a larger head
size for full attention, twice the block size for sliding windows): byte math, spans, wire
form, identity and negotiation. Uniform layouts keep their identity and fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from kvbridge.proto import (
    GroupSpec,
    KVGroup,
    KVLayout,
    LayerSpec,
    LayoutError,
    ModelSpec,
    TransferMode,
    WireError,
    attention_group,
    codec,
    negotiate,
    preset_layout,
)
from kvbridge.proto.layout import PageShape
from kvbridge.proto.negotiate import HEAD_MAJOR_SUFFIX

G1 = attention_group(1)
WIDE = PageShape(64, 1, 64)
"""``gemma4-wide``'s sliding group: 64-token blocks of 1 KV head x 64 (the full group, the
layout's own shape: 32-token blocks of 1 KV head x 128); 32 KiB pages both, in fp32."""


PINNED_WIDE = "73e4db87231a55c59a799217c8189e8d9c8580fd6f76a7abdd2ae1099083f96c"
PINNED_LLAMA = "c6ed56fa7c085e73d11082d8f5ef69948fdd33e63f78d42d947e5d73d15c8894"


def wide(
    page: PageShape | None = WIDE,
    *,
    order: str = "block-nhd",
    heads: int = 1,
    tp_size: int = 1,
    tp_rank: int = 0,
    name: str = "gemma4-wide",
) -> KVLayout:
    return KVLayout(
        model=ModelSpec(name, "float32", 1, heads, 128),
        block_size=32,
        groups=(GroupSpec(KVGroup.SELF, 10), GroupSpec(G1, 10, page)),
        layers=(LayerSpec("layers.1", KVGroup.SELF), LayerSpec("layers.0", G1)),
        tp_size=tp_size,
        tp_rank=tp_rank,
    ).with_order(order)


def test_each_group_has_the_byte_math_and_spans_of_its_own_page_shape() -> None:
    lay = wide(order="layer-nhd")
    assert lay.page(KVGroup.SELF) == PageShape(32, 1, 128) and lay.page(G1) == WIDE
    assert lay.sizes(G1)["N"] == 64 and lay.sizes(G1)["C"] == 64
    assert lay.sizes(KVGroup.SELF)["N"] == 32 and lay.sizes(KVGroup.SELF)["C"] == 128
    # equal page bytes (what vLLM guarantees), different strides inside the page
    assert lay.group_span_bytes(G1) == lay.group_span_bytes(KVGroup.SELF) == 16 * 1024
    assert lay.strides(G1)["N"] == 64 * 4 and lay.strides(KVGroup.SELF)["N"] == 128 * 4
    spans = lay.block_spans(G1, 3)
    assert [s.length for s in spans] == [16 * 1024] * 2
    assert spans[0].offset == 3 * lay.strides(G1)["B"]
    # a group of twice the head size and the same block size has twice the bytes
    big = wide(PageShape(32, 1, 256), order="layer-nhd")
    assert big.block_bytes(G1) == 2 * big.block_bytes(KVGroup.SELF) == 2 * 32 * 1024
    assert big.group_bytes(G1) == 10 * 64 * 1024
    assert [s.length for s in big.block_spans(G1, 9)] == [32 * 1024] * 2
    assert [s.length for s in big.block_spans(KVGroup.SELF, 9)] == [16 * 1024] * 2
    assert "pages of 64-token blocks of 1 KV heads x 64" in lay.describe()


def test_a_uniform_layout_keeps_the_identity_and_fingerprint_it_had() -> None:
    lay = wide(None)
    ident = lay.identity()
    assert set(ident) == {"model", "block_size", "groups", "layers", "tp_size"}
    assert lay.fingerprint() == hashlib.sha256(codec.pack("KVIdentity", ident)).digest()
    # the fingerprints before groups could have page shapes (block names root in them)
    assert lay.fingerprint().hex() == PINNED_WIDE
    assert preset_layout("llama3-8b").fingerprint().hex() == PINNED_LLAMA
    assert lay.span_bytes == lay.group_span_bytes(G1) == 32 * 128 * 4
    shaped = wide()
    assert shaped.identity()["pages"] == {"g1": [64, 1, 64]}
    assert shaped.fingerprint() != lay.fingerprint()


def test_page_shapes_cross_the_wire_and_bad_ones_are_refused() -> None:
    lay = wide(order="layer-hnd")
    back = KVLayout.from_bytes(lay.to_bytes())
    assert back == lay and back.page(G1) == WIDE and back.fingerprint() == lay.fingerprint()
    assert KVLayout.from_bytes(wide(None).to_bytes()).group(G1).page is None
    body = codec.unpack(lay.to_bytes(), "KVLayout")
    for bad, match in [
        ({"g1": [64, 1]}, "each page shape must be"),
        ({"g7": [64, 1, 64]}, "does not have"),
        ([64, 1, 64], "pages must be a map"),
        ({"g1": [64, True, 64]}, "expected an integer"),
    ]:
        with pytest.raises(WireError, match=match):
            KVLayout.from_bytes(codec.pack("KVLayout", {**body, "pages": bad}))
    with pytest.raises(LayoutError, match="block_size must be an integer >= 1"):
        KVLayout.from_bytes(codec.pack("KVLayout", {**body, "pages": {"g1": [0, 1, 64]}}))


def test_a_page_shape_is_refused_on_self_as_the_layouts_own_and_where_tp_cannot_split() -> None:
    with pytest.raises(LayoutError, match="group 'self' has the layout's own page shape"):
        replace(wide(None), groups=(GroupSpec(KVGroup.SELF, 10, WIDE), GroupSpec(G1, 10)))
    with pytest.raises(LayoutError, match="give None instead"):
        wide(PageShape(32, 1, 128))
    with pytest.raises(LayoutError, match="1 KV heads cannot be split over tp_size 2"):
        wide(heads=2, tp_size=2)  # the layout's 2 heads split; the group's 1 does not


def test_peers_negotiate_when_every_groups_page_shape_matches_and_name_the_group_if_not() -> None:
    assert negotiate(wide(), wide()).mode is TransferMode.WHOLE_BLOCK
    assert negotiate(wide(), wide(order="layer-nhd")).mode is TransferMode.PER_SPAN
    assert negotiate(wide(), wide(order="layer-hnd")).mode is TransferMode.REARRANGE
    for other, theirs in [
        (wide(None), "32-token blocks of 1 KV heads x 128 (the layout's own)"),
        (wide(PageShape(64, 1, 32)), "64-token blocks of 1 KV heads x 32"),
    ]:
        for a, b, local, remote in [
            (wide(), other, WIDE.describe(), theirs),
            (other, wide(), theirs, WIDE.describe()),
        ]:
            got = negotiate(a, b)
            assert got.mode is TransferMode.INCOMPATIBLE
            assert got.reason == (
                f"group 'g1' page shape differs: local {local}, remote {remote}"
            ), got.reason


def test_head_slices_take_each_groups_heads_and_shapes_still_have_to_match() -> None:
    name = "gemma4-wide" + HEAD_MAJOR_SUFFIX

    def packed(page: PageShape, tp_size: int, rank: int = 0) -> KVLayout:
        return wide(page, heads=2, tp_size=tp_size, tp_rank=rank, name=name, order="B L KV H N C")

    two = PageShape(64, 2, 64)
    assert negotiate(packed(two, 1), packed(two, 2, 1)).mode is TransferMode.HEAD_SLICE
    assert packed(two, 2).sizes(G1)["H"] == 1 and packed(two, 1).sizes(G1)["H"] == 2
    assert packed(two, 2).group_span_bytes(G1) == packed(two, 1).group_span_bytes(G1) // 2
    # another group shape is no head slice of it (the reason names the first difference)
    got = negotiate(packed(PageShape(64, 2, 32), 1), packed(two, 2))
    assert got.mode is TransferMode.INCOMPATIBLE, got

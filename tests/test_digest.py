"""Block digests: equal for equal KV in any outer order, different for any flipped byte."""

from __future__ import annotations

import pytest
import torch

from kvbridge.kernels import (
    DIGEST_BYTES,
    BlockMapping,
    block_digests,
    convert_blocks,
    new_key,
    span_digest,
)
from kvbridge.proto import KVLayout, LayoutError, Span, preset_layout


def _filled(order: str, seed: int = 0) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    layout = preset_layout("tiny", num_blocks=8, order=order)
    caches = layout.allocate()
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return layout, caches


def test_block_outermost_and_layer_separate_give_the_same_digest_for_the_same_kv() -> None:
    a, ca = _filled("block-nhd")
    b = preset_layout("tiny", num_blocks=8, order="layer-nhd")
    cb = b.allocate()
    convert_blocks(ca, a, cb, b, BlockMapping(list(range(8)), list(range(8))))
    key = new_key()
    da = block_digests(a.bind(ca), "self", range(8), key)
    db = block_digests(b.bind(cb), "self", range(8), key)
    assert da == db
    assert all(len(d) == DIGEST_BYTES for d in da)
    assert len(set(da)) == 8  # random blocks differ


def test_one_flipped_byte_or_another_key_changes_the_digest() -> None:
    layout, caches = _filled("block-nhd")
    bound = layout.bind(caches)
    before = block_digests(bound, "self", [3], 1)[0]
    assert block_digests(bound, "self", [3], 2)[0] != before
    raw = next(iter(caches.values())).view(torch.uint8)
    span = bound.block_spans("self", 3)[0]
    flat = raw.as_strided((layout.block_bytes("self") * 8,), (1,), 0)
    flat[span.offset + span.length - 1] ^= 1
    assert block_digests(bound, "self", [3], 1)[0] != before
    flat[span.offset + span.length - 1] ^= 1
    assert block_digests(bound, "self", [3], 1)[0] == before


def test_bad_keys_and_spans_outside_their_region_are_refused() -> None:
    layout, caches = _filled("block-nhd")
    bound = layout.bind(caches)
    with pytest.raises(ValueError, match="digest key"):
        block_digests(bound, "self", [0], -1)
    with pytest.raises(ValueError, match="digest key"):
        block_digests(bound, "self", [0], 1 << 64)
    region = bound.regions[0]
    with pytest.raises(LayoutError, match="outside its region"):
        span_digest(bound.regions, [Span(0, region.length - 8, 16)], 0)
    with pytest.raises(LayoutError, match="bound layout"):
        block_digests(layout, "self", [0], 0)

"""Block digests: equal for equal KV in any outer order, different for any flipped byte."""

from __future__ import annotations

import pytest
import torch

from kvbridge.kernels import (
    DIGEST_BYTES,
    BlockMapping,
    block_digests,
    convert_blocks,
    keyed_block_digests,
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


@pytest.mark.parametrize("order", ["block-nhd", "layer-nhd"])
def test_per_block_keys_give_each_block_the_digest_of_its_own_key(order: str) -> None:
    layout, caches = _filled(order, seed=3)
    bound = layout.bind(caches)
    ids, keys = [5, 0, 7, 3], [new_key(), 7, new_key(), 7]
    alone = [block_digests(bound, "self", [b], k)[0] for b, k in zip(ids, keys, strict=True)]
    one_span = [  # the block's bytes hashed span by span, in the layout's order
        span_digest(bound.regions, bound.block_spans("self", b), k)
        for b, k in zip(ids, keys, strict=True)
    ]
    assert keyed_block_digests(bound, "self", ids, keys, "xxh3-128") == alone == one_span
    assert block_digests(bound, "self", ids, 7) == [
        block_digests(bound, "self", [b], 7)[0] for b in ids
    ]
    with pytest.raises(ValueError, match="3 keys for 4 blocks"):
        keyed_block_digests(bound, "self", ids, keys[:3], "xxh3-128")
    with pytest.raises(ValueError, match="digest key"):
        keyed_block_digests(bound, "self", ids, [1, 2, 3, True], "xxh3-128")
    with pytest.raises(LayoutError, match=r"outside 0\.\.7"):
        keyed_block_digests(bound, "self", [8], [1], "xxh3-128")


def _packed(order: str, heads: int = 4, seed: int = 5) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    """vLLM's packed head-major pages (a page is ``(H, N, 2C)``, one span) of the tiny model."""
    import dataclasses

    from kvbridge.proto.negotiate import HEAD_MAJOR_SUFFIX

    base = preset_layout("tiny", num_blocks=8, order=order)
    model = dataclasses.replace(
        base.model, name=base.model.name + HEAD_MAJOR_SUFFIX, num_kv_heads=heads
    )
    layout = dataclasses.replace(base, model=model)
    caches = layout.allocate()
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return layout.bind(caches), caches


@pytest.mark.parametrize("order", ["layer-nhd", "block-nhd"])
def test_page_slice_digests_cover_each_run_of_heads_of_every_page_in_layer_order(
    order: str,
) -> None:
    import xxhash

    from kvbridge.kernels import head_digest_parts, page_slice_digests

    layout, _ = _packed(order)
    key = new_key()
    assert head_digest_parts(layout) == 4  # one digest per head of this rank
    # one slice: the whole-block digest (a page is its two adjacent halves)
    whole = page_slice_digests(layout, "self", [3, 6], key, 1)
    assert [d for (d,) in whole] == block_digests(layout, "self", [3, 6], key)
    # slice i of each page, layers in order: exactly those bytes, hashed with the key
    import ctypes

    page = 2 * layout.span_bytes
    for parts in (2, 4):
        (got,) = page_slice_digests(layout, "self", [6], key, parts)
        step = page // parts
        for i in range(parts):
            h = xxhash.xxh3_128(seed=key)
            for x in range(len(layout.owning_layers("self"))):
                k_span = layout.block_spans("self", 6)[2 * x] if order == "layer-nhd" else None
                if k_span is None:  # block-outermost: the block's pages back to back
                    (span,) = layout.block_spans("self", 6)
                    start = layout.regions[span.region].addr + span.offset + x * page
                else:
                    start = layout.regions[k_span.region].addr + k_span.offset
                h.update(ctypes.string_at(start + i * step, step))
            assert got[i] == h.digest(), (parts, i)
    # a page split in slices it does not divide into, another algorithm: refused
    with pytest.raises(LayoutError, match="does not split"):
        page_slice_digests(layout, "self", [0], key, 3)
    with pytest.raises(ValueError, match="xxh3-128"):
        page_slice_digests(layout, "self", [0], key, 2, "kvb-mlh32x4")


def test_only_head_major_pages_of_several_heads_get_head_digests() -> None:
    from kvbridge.kernels import head_digest_parts, page_slice_digests

    layout, _ = _filled("layer-kv-nhd")  # kvbridge's own pages: K and V apart
    assert head_digest_parts(layout.bind(_)) == 0
    with pytest.raises(LayoutError, match="not one span"):
        page_slice_digests(layout.bind(_), "self", [0], 1, 2)
    one, _ = _packed("layer-nhd", heads=1)
    assert head_digest_parts(one) == 0  # one head: a reader of a bigger TP size cannot exist


def test_a_helper_thread_hashes_a_share_of_the_blocks_and_changes_no_digest() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    layout, caches = _filled("block-nhd")
    bound = layout.bind(caches)
    key = new_key()
    alone = block_digests(bound, "self", range(8), key)
    with ThreadPoolExecutor(1) as helper:
        assert block_digests(bound, "self", range(8), key, helper=helper) == alone
        # a helper busy elsewhere never starts in time: this thread hashes every block
        gate = threading.Event()
        helper.submit(gate.wait, 10)
        assert block_digests(bound, "self", range(8), key, helper=helper) == alone
        gate.set()
    # a helper already shut down: the same
    assert block_digests(bound, "self", range(8), key, helper=helper) == alone
    with ThreadPoolExecutor(1) as helper, pytest.raises(ValueError, match="digest key"):
        block_digests(bound, "self", range(8), -1, helper=helper)


def test_xxh3_digests_are_plain_seeded_xxh3_128_of_the_spans_bytes_in_order() -> None:
    """The algorithm named ``xxh3-128`` is exactly ``xxhash.xxh3_128(seed=key)`` over the
    spans' bytes concatenated: odd sizes (around XXH3's 16/128/240-byte and 1 KiB stripe
    and 64-byte block edges), many spans, adjacent spans (merged into one call) and gaps,
    zero-length spans, two regions; and for blocks of both outer orders."""
    import ctypes

    import xxhash

    from kvbridge.proto import Region

    gen = torch.Generator().manual_seed(7)
    bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (70001, 9001)]
    regions = [Region(t.data_ptr(), t.numel()) for t in bufs]
    raw = [ctypes.string_at(t.data_ptr(), t.numel()) for t in bufs]
    key = new_key()
    sizes = [0, 1, 15, 16, 17, 127, 128, 129, 239, 240, 241, 1023, 1024, 1025, 4097, 65537]
    for size in sizes:  # one span of each size, at an odd offset
        want = xxhash.xxh3_128(raw[0][3 : 3 + size], seed=key).digest()
        assert span_digest(regions, [Span(0, 3, size)], key) == want, size
    spans, expected = [], b""
    offset = 1
    for i, size in enumerate(sizes * 3):  # many spans: adjacent runs, gaps, both regions
        region = i % 5 == 4 and size < len(raw[1])
        off = (offset if not region else 11 * i) % (len(raw[region]) - size)
        spans.append(Span(int(region), off, size))
        expected += raw[region][off : off + size]
        offset = off + size + (0 if i % 3 else 7)  # two of three adjacent to the previous
    assert len(expected) > 100_000
    assert span_digest(regions, spans, key) == xxhash.xxh3_128(expected, seed=key).digest()

    for order in ("block-nhd", "layer-nhd"):
        layout, caches = _filled(order, seed=3)
        bound = layout.bind(caches)
        keys = [new_key() for _ in range(8)]
        got = keyed_block_digests(bound, "self", range(8), keys, "xxh3-128")
        for b in range(8):
            data = b"".join(
                ctypes.string_at(bound.regions[s.region].addr + s.offset, s.length)
                for s in bound.block_spans("self", b)
            )
            assert got[b] == xxhash.xxh3_128(data, seed=keys[b]).digest(), (order, b)
        assert block_digests(bound, "self", [5], keys[5]) == [got[5]]

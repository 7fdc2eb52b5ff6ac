"""The data side of KV cache groups of their own page shape (vLLM's hybrid groups of
Gemma-4: the full group's head size is twice the sliding group's, whose blocks are twice
as long, at equal page bytes): vLLM's tensors described per group, the offload daemon's
shared-page check, descriptor tables, digests and conversions in each group's own shape.
Blocks moved between real NIXL agents: tests/test_layout_pages_nixl.py."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xxhash

from kvbridge.connector.offload.session import check_shared_pages
from kvbridge.connector.transport.nixl_descs import descriptor_table, slice_table, strided_table
from kvbridge.connector.vllm.kinds import layer_pages
from kvbridge.connector.vllm.views import PACKED_SUFFIX, logical_views
from kvbridge.kernels import (
    BlockMapping,
    block_digests,
    convert_blocks,
    head_digest_parts,
    page_slice_digests,
)
from kvbridge.proto import (
    ConfigError,
    KVGroup,
    KVLayout,
    LayoutError,
    attention_group,
)
from kvbridge.proto.layout import PageShape
from kvbridge.proto.negotiate import HEAD_MAJOR_SUFFIX
from kvbridge.worker.offload.tiered import fingerprint
from tests.harness.wide_layouts import wide_layout

SELF, G1 = KVGroup.SELF, attention_group(1)
NB = 6
FULL = (1, 128, 32)  # vLLM's spec: KV heads of this rank, head size, block size
SLIDING = (1, 64, 64)


WIDE = PageShape(64, 1, 64)


def wide(
    page: PageShape | None = WIDE,
    *,
    heads: int = 1,
    order: str = "block-nhd",
    name: str = "gemma4-wide",
) -> KVLayout:
    """Two layers per group (``self``: full attention, ``g1``: sliding)."""
    return wide_layout(page, num_blocks=NB, heads=heads, order=order, name=name)


def vllm_pages(pad: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM 0.32's Gemma-4 KV cache on its CPU backend, block-outermost (``BLHNC``): one
    buffer; tensor ``i`` holds layer ``i`` of each group (full layers 1 and 3, sliding 0
    and 2), each layer's view a packed ``(B, H, N, 2C)`` page in its group's shape.
    ``pad``: bytes after each sliding page (vLLM's padded pages)."""
    page = 32 * 128 * 2 * 4  # 32 KiB, both groups
    block = 2 * (page + pad)
    raw = torch.zeros(NB * block, dtype=torch.int8)
    out = {}
    for name, layer, (heads, size, tokens), pad_here in [
        ("layers.1", 0, FULL, 0),
        ("layers.0", 0, SLIDING, pad),
        ("layers.3", 1, FULL, 0),
        ("layers.2", 1, SLIDING, pad),
    ]:
        c2 = 2 * size * 4
        view = torch.as_strided(
            raw,
            (NB, heads, tokens, c2),
            (block, tokens * c2, c2, 1),
            layer * (page + pad_here),
        )
        out[name] = view.view(torch.float32)
    return raw, out


GROUPS = {"layers.0": G1, "layers.1": SELF, "layers.2": G1, "layers.3": SELF}
PAGES = {"layers.0": SLIDING, "layers.1": FULL, "layers.2": SLIDING, "layers.3": FULL}


def described(caches: dict[str, torch.Tensor]) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    views, interior = logical_views(
        caches, num_kv_heads=1, head_size=128, block_size=32, pages=PAGES
    )
    assert interior == "HNC"
    lay = KVLayout.from_tensors(
        views, model_name="gemma4-wide" + PACKED_SUFFIX, block_size=32, layer_groups=GROUPS
    )
    return lay, views


def test_vllms_gemma4_pages_are_described_each_group_in_its_own_shape() -> None:
    raw, caches = vllm_pages()
    lay, views = described(caches)
    assert lay.page(G1) == PageShape(64, 1, 64) and lay.group(SELF).page is None
    assert lay.model.head_size == 128 and lay.block_size == 32
    assert lay.kind == "block-outermost" and lay.block_bytes(G1) == lay.block_bytes(SELF)
    assert lay.regions[0] == lay.regions[1] and lay.regions[0].addr == raw.data_ptr()
    assert lay.bind(views) == lay  # bound again from the same tensors
    check_shared_pages(lay)  # the daemon's self-sized slots hold g1's blocks as they are
    # the sliding layer's logical view sees its own tokens and channels of the shared page
    # (packed K|V: the view's halves are the page's halves, each read as N H C)
    caches["layers.0"][2, 0, 5, 64 + 3] = 7.0  # block 2, token 5, channel 67 of 2C
    assert views["layers.0"][0, 2, (5 * 128 + 67) // 64, 0, 3] == 7.0

    # and block 2 of g1 is the bytes of block 2 of self
    def where(group: KVGroup) -> list[tuple[int, int]]:
        return [
            (lay.regions[x.region].addr + x.offset, x.length) for x in lay.block_spans(group, 2)
        ]

    assert where(G1) == where(SELF)


def test_layers_take_their_groups_shape_and_one_shape_for_all_gives_none() -> None:
    def spec(heads: int, size: int, block: int) -> Any:
        return SimpleNamespace(
            num_kv_heads=heads, head_size=size, dtype="float32", block_size=block
        )

    config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=["l0"], kv_cache_spec=spec(1, 64, 64)),
            SimpleNamespace(layer_names=["l1"], kv_cache_spec=spec(1, 128, 32)),
        ]
    )
    got = layer_pages(config, ["l0", "l1", "l2", "l3"], {"l2": "l0", "l3": "l1"})
    assert got == {"l0": (1, 64, 64), "l1": (1, 128, 32), "l2": (1, 64, 64), "l3": (1, 128, 32)}
    config.kv_cache_groups[0].kv_cache_spec = spec(1, 128, 32)
    assert layer_pages(config, ["l0", "l1"]) is None  # uniform: the model's shape, as before
    assert layer_pages(None, ["l0"]) is None


def test_a_layer_of_another_shape_without_its_groups_page_is_refused_by_name() -> None:
    _, caches = vllm_pages()
    with pytest.raises(LayoutError, match=r"layer 'layers.0'.*block_size 32, 1 KV heads of 128"):
        logical_views(caches, num_kv_heads=1, head_size=128, block_size=32)
    views, _ = logical_views(caches, num_kv_heads=1, head_size=128, block_size=32, pages=PAGES)
    # a group whose layers disagree on their shape
    with pytest.raises(
        LayoutError, match=r"layer 'layers.0': 64-token.*other layers of group 'g1'"
    ):
        KVLayout.from_tensors(
            views,
            model_name="m",
            block_size=32,
            layer_groups={"layers.0": G1, "layers.1": G1, "layers.2": SELF, "layers.3": SELF},
        )


def test_padded_pages_stay_refused() -> None:
    _, caches = vllm_pages(pad=256)
    with pytest.raises(LayoutError, match=r"not dense|overlap"):
        described(caches)


def test_the_daemon_refuses_a_group_whose_blocks_have_other_bytes_by_name() -> None:
    for page in (PageShape(32, 1, 256), PageShape(64, 1, 32)):
        lay = wide(page)
        lay = lay.bind(lay.allocate())
        with pytest.raises(ConfigError, match=r"group 'g1' has blocks of \d+ bytes"):
            check_shared_pages(lay)


def test_descriptor_tables_take_the_groups_span_and_page_length() -> None:
    big = PageShape(32, 1, 256)  # twice self's page bytes
    for order in ("layer-nhd", "block-nhd", "layer-kv-nhd"):
        lay = wide(big, order=order)
        lay = lay.bind(lay.allocate())
        span = lay.group_span_bytes(G1)
        assert span == 2 * lay.group_span_bytes(SELF)
        table = descriptor_table(lay, G1, per_span=True)
        assert set(table[:, 1].tolist()) == {span}
        for b in (0, 3, NB - 1):
            rows = [int(r[0]) for r in table[b * 4 : (b + 1) * 4]]
            spans = lay.block_spans(G1, b)
            if lay.block_outermost:  # one span: the four descriptors follow each other
                first = lay.regions[spans[0].region].addr + spans[0].offset
                assert rows == [first + i * span for i in range(4)]
            else:
                assert rows == [lay.regions[s.region].addr + s.offset for s in spans]
        assert set(strided_table(lay, G1, per_span=True)[:, 1].tolist()) == {span}
        if order != "layer-kv-nhd":  # a page is one span when KV is third
            pages = slice_table(lay, G1, 1, 2)
            assert set(pages[:, 1].tolist()) == {span}  # half a page of 2 spans
            first = lay.block_spans(G1, 0)[0]
            assert int(pages[0, 0]) == lay.regions[first.region].addr + first.offset + span


def test_head_digests_cut_each_groups_own_pages() -> None:
    big = PageShape(32, 2, 256)
    name = "gemma4-wide" + HEAD_MAJOR_SUFFIX
    lay = wide(big, heads=2, order="B L KV H N C", name=name)
    caches = lay.allocate()
    gen = torch.Generator().manual_seed(4)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    lay = lay.bind(caches)
    key = 77
    got = page_slice_digests(lay, G1, [1, 4], key, 2)
    for b, digests in zip([1, 4], got, strict=True):
        page = 2 * lay.group_span_bytes(G1)
        # memory order of each layer's page (B L KV H N C: K's heads, tokens, channels,
        # then V's)
        raw = b"".join(
            caches[x.name][:, b].permute(0, 2, 1, 3).contiguous().numpy().tobytes()
            for x in lay.owning_layers(G1)
        )
        cut = page // 2
        halves = [
            b"".join(raw[p + i * cut : p + (i + 1) * cut] for p in range(0, len(raw), page))
            for i in (0, 1)
        ]
        want = [xxhash.xxh3_128_digest(h, seed=key) for h in halves]
        assert digests == want
    # one digest per head for every group, so groups of other heads per rank get none
    assert head_digest_parts(lay) == 2
    assert (
        head_digest_parts(wide(PageShape(64, 1, 64), heads=2, order="B L KV H N C", name=name)) == 0
    )


def test_blocks_convert_between_orders_in_each_groups_own_shape() -> None:
    src_lay = wide(PageShape(64, 2, 64), heads=2, order="layer-nhd")
    dst_lay = wide(PageShape(64, 2, 64), heads=2, order="block-hnd")
    src, dst = src_lay.allocate(), dst_lay.allocate()
    gen = torch.Generator().manual_seed(5)
    for t in src.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    for group in (SELF, G1):
        convert_blocks(src, src_lay, dst, dst_lay, BlockMapping([4, 1], [0, 5]), group=group)
        for x in src_lay.owning_layers(group):
            assert torch.equal(dst[x.name][:, 0], src[x.name][:, 4])
            assert torch.equal(dst[x.name][:, 5], src[x.name][:, 1])
    # the digest is over the group's spans in block_spans order: equal in both orders only
    # where the inner order is the same
    same = wide(PageShape(64, 2, 64), heads=2, order="block-nhd")
    other = same.allocate()
    convert_blocks(src, src_lay, other, same, BlockMapping([4], [2]), group=G1)
    assert block_digests(src_lay.bind(src), G1, [4], 9) == block_digests(
        same.bind(other), G1, [2], 9
    )
    assert block_digests(src_lay.bind(src), G1, [4], 9) != block_digests(
        src_lay.bind(src), G1, [3], 9
    )


def test_a_disk_tier_of_a_uniform_layout_keeps_its_fingerprint() -> None:
    lay = wide(None)
    m = lay.model
    text = (
        f"{m.name}|{m.dtype}|{m.num_layers}|{m.num_kv_heads}|{m.head_size}|{lay.block_size}|"
        f"{lay.tp_size}|{' '.join(lay.order)}|{lay.block_bytes(SELF)}"
    )
    assert fingerprint(lay) == hashlib.sha256(text.encode()).digest()
    assert fingerprint(wide()) != fingerprint(lay)


def test_an_offload_session_through_a_rearrange_staging_cache_is_refused_at_the_handshake() -> None:
    """The staging cache converts every group's blocks as ``self``-shaped pages: right for
    a group of ``self``'s shape only, so a worker with a group of its own shape and a pool
    in another inner order get no session (offload off, recompute), with the fix named."""
    from kvbridge.connector.control.types import PeerInfo, Role, mode_to_pb, peer_to_pb
    from kvbridge.connector.offload import OffloadClientConfig
    from kvbridge.connector.offload.session import handshake
    from kvbridge.connector.transport import LocalMemory
    from kvbridge.proto import EngineId, IncompatibleLayoutError, TransferMode
    from kvbridge.proto import offload_pb2 as pb

    def session(local: KVLayout, pool: KVLayout, mode: TransferMode) -> None:
        daemon = PeerInfo(EngineId("daemon"), Role.OFFLOAD, pool, b"md")
        answer = pb.OffloadHandshakeResponse(
            peer=peer_to_pb(daemon), mode=mode_to_pb(mode), instance="i", session="s"
        )
        transport = SimpleNamespace(metadata=lambda: b"mine", name="w")
        handshake(
            lambda *a: answer,
            OffloadClientConfig(),
            transport,  # type: ignore[arg-type]
            LocalMemory(1, local.bind(local.allocate()), "cpu"),
            caches={},
        )

    two = PageShape(64, 2, 64)  # 2 heads: HND and NHD differ
    pool = wide(two, heads=2, order="block-nhd").with_num_blocks(self=4)
    shaped = r"groups of their own page shape \(\['g1'\]\)"
    with pytest.raises(IncompatibleLayoutError, match=shaped):
        session(wide(two, heads=2, order="layer-hnd"), pool, TransferMode.REARRANGE)
    with pytest.raises(IncompatibleLayoutError, match=r"--order"):
        session(wide(two, heads=2, order="block-hnd"), pool, TransferMode.REARRANGE)

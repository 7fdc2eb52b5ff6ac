"""Blocks of a KV cache group of its own page shape, READ between real NIXL agents (one
process each, tests/harness/transport_peer.py): every group's bytes land bit-exact in the
reader's order, and the reader's digests over the group's spans equal the writer's and
catch one flipped byte."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.proto import KVGroup, KVLayout, attention_group
from kvbridge.proto.layout import PageShape
from tests.harness.peer import PeerProc, start_peers
from tests.harness.transport_contract import assert_clean_close
from tests.harness.wide_layouts import wide_layout

pytestmark = pytest.mark.slow

SELF, G1 = KVGroup.SELF, attention_group(1)
NB = 8
PAGES = {
    # gemma4-wide with 2 KV heads: the sliding group's blocks twice as long, heads half as wide
    "wide": PageShape(64, 2, 64),
    # a group of twice self's page bytes: a table built from self's span length is wrong
    "big": PageShape(32, 2, 256),
}


def layout(page: PageShape, order: str) -> KVLayout:
    return wide_layout(page, num_blocks=NB, heads=2, order=order)


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[PeerProc, PeerProc]]:
    reader, target = start_peers("pages-reader", "pages-target")
    try:
        yield reader, target
        assert_clean_close(reader)
        assert_clean_close(target)
    finally:
        reader.stop()
        target.stop()


@pytest.mark.parametrize("page", sorted(PAGES))
@pytest.mark.parametrize(
    ("order", "mode"),
    [("block-nhd", "whole_block"), ("layer-nhd", "per_span"), ("layer-kv-nhd", "per_span")],
)
def test_each_groups_blocks_land_bit_exact_and_their_digests_check(
    peers: tuple[PeerProc, PeerProc], page: str, order: str, mode: str
) -> None:
    reader, target = peers
    theirs = target.call("setup_layout", layout=layout(PAGES[page], "block-nhd").to_bytes(), seed=1)
    mine = reader.call("setup_layout", layout=layout(PAGES[page], order).to_bytes(), seed=2)
    link = reader.call(
        "connect",
        peer="pages-target",
        metadata=theirs["metadata"],
        layout=theirs["layout"],
        mem=mine["mem"],
    )
    assert link["mode"] == mode
    local, remote, key = [3, 0, 6], [1, 5, 7], 0x5EED
    for group in (SELF, G1):
        before = reader.call("blocks", mem=mine["mem"], ids=[1], group=group)["blocks"]
        got = reader.call(
            "transfer",
            kind="read",
            link=link["link"],
            local_ids=local,
            remote_ids=remote,
            timeout_s=10.0,
            group=group,
        )
        want = target.call("blocks", mem=theirs["mem"], ids=remote, group=group)["blocks"]
        assert reader.call("blocks", mem=mine["mem"], ids=local, group=group)["blocks"] == want
        assert got["nbytes"] == sum(len(b) for b in want)
        assert reader.call("blocks", mem=mine["mem"], ids=[1], group=group)["blocks"] == before
        # digests over the group's spans: a block-outermost block and its layer-separate
        # spans give one digest for the same KV
        sent = target.call("digests", mem=theirs["mem"], ids=remote, key=key, group=group)
        landed = reader.call("digests", mem=mine["mem"], ids=local, key=key, group=group)
        assert landed["digests"] == sent["digests"]
        reader.call("poke", mem=mine["mem"], group=group, block_id=0, offset=4097)
        poked = reader.call("digests", mem=mine["mem"], ids=local, key=key, group=group)
        changed = [a != b for a, b in zip(poked["digests"], sent["digests"], strict=True)]
        assert changed == [False, True, False]
    reader.call("disconnect", link=link["link"])

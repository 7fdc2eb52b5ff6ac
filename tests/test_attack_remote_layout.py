"""Attacks on a peer's layout as it arrives on the wire (KVLayout.from_bytes in the
handshake): a peer that lies about its regions (none, other lengths, memory it never
registered, ``one_region`` for layer-separate memory) must be refused with a typed error at
connect or fail the READ, never land bytes from outside its registered KV. Real NIXL in
subprocesses (tests/harness/transport_contract.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvbridge.proto import KVLayout, Region
from tests.harness.peer import PeerError
from tests.harness.transport_contract import blocks, open_pair, transfer

BLOCK, LAYER = 0, 1  # TARGET_MEMS / READER_MEMS indices: tiny block-nhd, tiny layer-nhd


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Any]]:
    with open_pair("nixl") as p:
        yield p


def connect_as(pair: dict[str, Any], rmem: int, layout: KVLayout) -> dict[str, Any]:
    return pair["reader"].call(
        "connect", peer="target", metadata=pair["md"], layout=layout.to_bytes(), mem=rmem
    )


def target_layout(pair: dict[str, Any], tmem: int) -> KVLayout:
    return KVLayout.from_bytes(pair["tmems"][tmem]["layout"])


def test_a_layout_without_regions_is_a_layout_error(pair: dict[str, Any]) -> None:
    bare = replace(target_layout(pair, BLOCK), regions=())
    with pytest.raises(PeerError, match=r"LayoutError: .*regions"):
        connect_as(pair, BLOCK, bare)


def test_a_region_of_another_length_is_a_layout_error(pair: dict[str, Any]) -> None:
    real = target_layout(pair, BLOCK)
    r = real.regions[0]
    with pytest.raises(PeerError, match=r"LayoutError: remote region 0 is"):
        connect_as(pair, BLOCK, real.with_regions([Region(r.addr, r.length // 2, r.device)]))


def test_memory_the_peer_never_registered_is_refused(pair: dict[str, Any]) -> None:
    real = target_layout(pair, BLOCK)
    r = real.regions[0]
    moved = real.with_regions([Region(r.addr + r.length, r.length, r.device)])
    with pytest.raises(PeerError, match=r"PeerError: could not prepare descriptors"):
        connect_as(pair, BLOCK, moved)
    assert pair["reader"].call("state")["links_down"] == 0


def test_one_region_claimed_for_layer_separate_memory_reads_only_registered_bytes(
    pair: dict[str, Any],
) -> None:
    real = target_layout(pair, LAYER)
    assert real.layer_separate and real.num_regions > 1
    r0 = real.regions[0]
    forged = replace(
        real, one_region=True, regions=(Region(r0.addr, real.group_bytes("self"), r0.device),)
    )
    before = blocks(pair["reader"], LAYER, [3])
    try:
        link = connect_as(pair, LAYER, forged)["link"]
    except PeerError as exc:
        assert "could not prepare descriptors" in str(exc)
        return
    try:
        transfer(pair["reader"], "read", link, [3], [5])
    except PeerError:
        assert blocks(pair["reader"], LAYER, [3]) == before
    else:  # NIXL let it through: every byte must be the target's own registered KV
        got = blocks(pair["reader"], LAYER, [3])
        assert got == blocks(pair["target"], LAYER, [5])
    finally:
        pair["reader"].call("disconnect", link=link)

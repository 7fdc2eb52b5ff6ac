"""Descriptor tables, id checks and config of the transport, without any NIXL process."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import numpy.typing as npt
import pytest

from kvbridge.connector.transport import NixlConfig, TransferHandle, TransferState
from kvbridge.connector.transport.base import wait_async
from kvbridge.connector.transport.checks import check_transfer_ids
from kvbridge.connector.transport.nixl_descs import (
    descriptor_indices,
    descriptor_table,
    request_indices,
    strided_indices,
    strided_table,
)
from kvbridge.proto import ConfigError, KVLayout, LayoutError, Region, TransferError, preset_layout
from tests.harness.descs import expand_strided


def bound(order: str, preset: str = "tiny", num_blocks: int = 8) -> KVLayout:
    layout = preset_layout(preset, num_blocks=num_blocks, order=order)
    base = 1 << 32
    regions = []
    for i in range(layout.num_regions):
        regions.append(Region(base, layout.region_bytes(i)))
        base += layout.region_bytes(i) + 4096
    return layout.with_regions(regions)


def spans_as_rows(layout: KVLayout, block: int) -> list[tuple[int, int]]:
    return [
        (layout.regions[s.region].addr + s.offset, s.length)
        for s in layout.block_spans("self", block)
    ]


@pytest.mark.parametrize("order", ["block-nhd", "layer-nhd", "layer-kv-nhd", "block-hnd"])
@pytest.mark.parametrize("preset", ["tiny", "kv-share-third"])
def test_per_span_table_matches_the_layouts_own_spans(order: str, preset: str) -> None:
    layout = bound(order, preset, num_blocks=5)
    table = descriptor_table(layout, "self", per_span=True)
    per = 2 * len(layout.owning_layers("self"))
    assert table.shape == (5 * per, 3)
    for b in range(5):
        rows = [(int(a), int(n)) for a, n, _ in table[b * per : (b + 1) * per]]
        if layout.block_outermost:  # the layout names one span; per-span rows tile it in order
            (start, length), *_ = spans_as_rows(layout, b)
            n = layout.span_bytes
            assert rows == [(start + i * n, n) for i in range(length // n)]
        else:
            assert rows == spans_as_rows(layout, b)


def test_whole_block_table_has_one_row_per_block_and_needs_block_outermost() -> None:
    layout = bound("block-nhd")
    table = descriptor_table(layout, "self", per_span=False)
    assert [(int(a), int(n)) for a, n, _ in table] == [
        spans_as_rows(layout, b)[0] for b in range(8)
    ]
    with pytest.raises(LayoutError, match="block-outermost"):
        descriptor_table(bound("layer-nhd"), "self", per_span=False)
    with pytest.raises(LayoutError, match="no registered regions"):
        descriptor_table(preset_layout("tiny"), "self", per_span=False)


def test_descriptor_indices_expand_blocks_in_the_given_order() -> None:
    assert descriptor_indices([2, 0], 1).tolist() == [2, 0]
    assert descriptor_indices([2, 0], 3).tolist() == [6, 7, 8, 0, 1, 2]


ORDERS = ["block-nhd", "layer-nhd", "layer-kv-nhd", "block-hnd", "KV B L N H C"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("preset", ["tiny", "kv-share-third"])
@pytest.mark.parametrize("per_span", [True, False])
def test_strided_table_expands_to_exactly_the_dense_tables_descriptors(
    order: str, preset: str, per_span: bool
) -> None:
    layout = bound(order, preset, num_blocks=6)
    if not per_span and not layout.block_outermost:
        with pytest.raises(LayoutError, match="block-outermost"):
            strided_table(layout, "self", per_span)
        return
    dense = descriptor_table(layout, "self", per_span)
    table = strided_table(layout, "self", per_span)
    expanded = expand_strided(table)
    # one row per region: the whole pool, or each owning layer of a layer-separate one
    regions = len(layout.owning_layers("self")) if per_span and layout.layer_separate else 1
    assert table.shape == (regions, 5)
    assert (table[:, 3] == table[:, 1]).all()  # every row is one contiguous run
    assert sorted(map(tuple, expanded.tolist())) == sorted(map(tuple, dense.tolist()))
    every = list(range(6))
    assert (expanded[strided_indices(layout, "self", every, per_span)] == dense).all()


def test_strided_descriptors_follow_the_physical_order() -> None:
    # layer-nhd: layer, then block, then K/V; layer-kv-nhd: layer, K/V, then block
    n, per = 5, 8
    assert strided_indices(bound("layer-nhd", num_blocks=n), "self", [3], True).tolist() == [
        (s // 2) * 2 * n + 3 * 2 + s % 2 for s in range(per)
    ]
    assert strided_indices(bound("layer-kv-nhd", num_blocks=n), "self", [3], True).tolist() == [
        s * n + 3 for s in range(per)
    ]
    assert strided_indices(bound("block-nhd", num_blocks=n), "self", [3, 1], True).tolist() == [
        *range(24, 32),
        *range(8, 16),
    ]
    assert strided_indices(bound("block-nhd", num_blocks=n), "self", [3, 1], False).tolist() == [
        3,
        1,
    ]
    with pytest.raises(LayoutError, match="5 columns"):
        expand_strided(descriptor_table(bound("block-nhd"), "self", False))


def _pairs(
    local: KVLayout,
    remote: KVLayout,
    idx: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]],
    tables: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]],
) -> list[tuple[int, int, int]]:
    li, ri = idx
    lt, rt = tables
    assert li.shape == ri.shape and (lt[li, 1] == rt[ri, 1]).all()
    return sorted(zip(lt[li, 0].tolist(), rt[ri, 0].tolist(), lt[li, 1].tolist(), strict=True))


@pytest.mark.parametrize(
    ("local_order", "remote_order", "per_span"),
    [
        ("block-nhd", "block-nhd", False),
        ("layer-nhd", "layer-nhd", True),
        ("block-nhd", "layer-nhd", True),
        ("layer-nhd", "block-nhd", True),
        ("layer-kv-nhd", "block-nhd", True),
        ("block-nhd", "block-nhd", True),
    ],
)
@pytest.mark.parametrize("preset", ["tiny", "kv-share-third"])
def test_request_indices_pair_the_same_spans_whatever_each_sides_pool_size(
    local_order: str, remote_order: str, per_span: bool, preset: str
) -> None:
    local = bound(local_order, preset, num_blocks=5)
    remote = bound(remote_order, preset, num_blocks=11)
    local_ids, remote_ids = [4, 0, 2], [10, 3, 7]
    # what must move: span s of local block i <-> span s of remote block j, from block_spans
    want = []
    for i, j in zip(local_ids, remote_ids, strict=True):
        dense_l = descriptor_table(local, "self", per_span)
        dense_r = descriptor_table(remote, "self", per_span)
        per = dense_l.shape[0] // 5
        for s in range(per):
            a, b = dense_l[i * per + s], dense_r[j * per + s]
            want.append((int(a[0]), int(b[0]), int(a[1])))
    for strided in (False, True):
        build = strided_table if strided else descriptor_table
        tables = (build(local, "self", per_span), build(remote, "self", per_span))
        if strided:
            tables = (expand_strided(tables[0]), expand_strided(tables[1]))
        idx = request_indices(
            local, remote, "self", local_ids, remote_ids, per_span=per_span, strided=strided
        )
        assert (np.diff(idx[0]) > 0).all()  # listed in local order, each descriptor once
        assert _pairs(local, remote, idx, tables) == sorted(want)


def _merged(
    idx: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]],
    tables: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]],
) -> int:
    """Descriptors left after NIXL's merge: neighbours adjacent in both lists and in memory."""
    li, ri = idx
    lt, rt = tables
    glued = (
        (np.diff(li) == 1)
        & (np.diff(ri) == 1)
        & (lt[li[:-1], 0] + lt[li[:-1], 1] == lt[li[1:], 0])
        & (rt[ri[:-1], 0] + rt[ri[:-1], 1] == rt[ri[1:], 0])
    )
    return int(li.shape[0] - glued.sum())


@pytest.mark.parametrize(
    ("order", "per_span", "dense_left", "strided_left"),
    [
        ("block-nhd", False, 1, 1),  # whole blocks: one run either way
        ("layer-nhd", True, 16 * 4, 4),  # dense: K+V pairs; strided: one run per layer
        ("layer-kv-nhd", True, 16 * 8, 4),  # dense: nothing; strided: one run per layer
    ],
)
def test_strided_lists_let_sequential_blocks_merge_into_one_run_per_region(
    order: str, per_span: bool, dense_left: int, strided_left: int
) -> None:
    layout = bound(order, num_blocks=16)
    ids = list(range(16))
    for strided, left in ((False, dense_left), (True, strided_left)):
        build = strided_table if strided else descriptor_table
        table = build(layout, "self", per_span)
        if strided:
            table = expand_strided(table)
        idx = request_indices(layout, layout, "self", ids, ids, per_span=per_span, strided=strided)
        assert _merged(idx, (table, table)) == left


def test_check_transfer_ids_rejects_bad_ids_and_unequal_lists() -> None:
    a, b = bound("block-nhd"), bound("layer-nhd", num_blocks=4)
    check_transfer_ids(a, b, "self", [7, 0], [3, 1])
    with pytest.raises(TransferError, match="equal length"):
        check_transfer_ids(a, b, "self", [0, 1], [0])
    with pytest.raises(LayoutError, match=r"block id 4 of group 'self' is outside 0\.\.3"):
        check_transfer_ids(a, b, "self", [0], [4])
    with pytest.raises(LayoutError, match="block id -1"):
        check_transfer_ids(a, b, "self", [-1], [0])
    with pytest.raises(LayoutError, match="True"):
        check_transfer_ids(a, b, "self", [True], [0])  # type: ignore[list-item]


def test_nixl_config_names_the_bad_knob() -> None:
    with pytest.raises(ConfigError, match="progress_interval_s"):
        NixlConfig("x", progress_interval_s=0)
    with pytest.raises(ConfigError, match="name"):
        NixlConfig("")
    with pytest.raises(ConfigError, match="strided_descriptors"):
        NixlConfig("x", strided_descriptors=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="native_progress"):
        NixlConfig("x", native_progress="yes")  # type: ignore[arg-type]
    assert NixlConfig("x").strided_descriptors


class _SlowHandle(TransferHandle):
    def __init__(self) -> None:
        self.waited_on: str | None = None

    def poll(self) -> TransferState:
        return "done"

    def wait(self, timeout_s: float | None = None) -> None:
        import threading

        time.sleep(0.05)
        self.waited_on = threading.current_thread().name

    def release(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def num_descriptors(self) -> int:
        return 0


def test_wait_async_keeps_blocking_waits_off_the_event_loop_thread() -> None:
    import threading

    handle = _SlowHandle()

    async def main() -> str:
        await wait_async(handle, 1.0)
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert handle.waited_on is not None and handle.waited_on != loop_thread

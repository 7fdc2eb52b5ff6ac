"""Descriptor tables, id checks and config of the transport, without any NIXL process."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvbridge.proto.errors import ConfigError, LayoutError, TransferError
from kvbridge.proto.layout import KVLayout, Region
from kvbridge.proto.presets import preset_layout
from kvbridge.worker.nixl_descs import descriptor_indices, descriptor_table
from kvbridge.worker.nixl_transport import NixlConfig
from kvbridge.worker.transport import TransferHandle, TransferState, check_transfer_ids, wait_async


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

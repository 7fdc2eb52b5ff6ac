"""The offload daemon's pool memory: the layout's own tensors, on memory advised for huge
pages (a CMA READ from a pool of 4 KiB pages took about twice the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.proto import preset_layout
from kvbridge.worker.offload.hugepages import HUGE_PAGE_BYTES, allocate_pool


@pytest.mark.parametrize(
    ("preset", "order"),
    [
        ("tiny", "block-nhd"),
        ("tiny", "layer-nhd"),
        ("small", "layer-hnd"),
        ("llama3-8b", "block-nhd"),
    ],
)
def test_the_pool_gets_the_views_layout_allocate_makes_zeroed_and_aligned(
    preset: str, order: str
) -> None:
    layout = preset_layout(preset, num_blocks=12, order=order)
    want, got = layout.allocate(), allocate_pool(layout)
    assert list(got) == list(want)
    for name, t in got.items():
        w = want[name]
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) == (
            w.shape, w.stride(), w.storage_offset(), w.dtype, w.device
        ), name  # fmt: skip
        assert not t.any(), name
    # aliases (a layer reading another's KV) and shared buffers stay shared
    same = [[want[a] is want[b] for b in want] for a in want]
    assert [[got[a] is got[b] for b in got] for a in got] == same
    bound = layout.bind(got)  # the regions are where the layout says
    assert all(r.addr % HUGE_PAGE_BYTES == 0 for r in bound.regions)
    # the memory is usable and each view its own: one element written shows in one view
    first = next(iter(got.values()))
    first[(0,) * first.dim()] = 1
    assert sum(int(t.count_nonzero()) for t in {id(t): t for t in got.values()}.values()) == 1


def test_the_pool_memory_is_advised_for_huge_pages_where_linux_has_them() -> None:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("no transparent huge pages on this machine")
    layout = preset_layout("llama3-8b", num_blocks=4, order="block-nhd")  # 8 MiB
    pool = allocate_pool(layout)
    (region,) = layout.bind(pool).regions
    addr = region.addr
    eligible = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("THPeligible:"):
            eligible = line.split()[1]
            break
    assert eligible == "1"

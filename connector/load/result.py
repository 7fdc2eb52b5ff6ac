"""The one place a :class:`~kvbridge.connector.base.LoadResult` is built."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.load.reads import ReadFigures
from kvbridge.proto.types import BlockId

__all__ = ["load_result"]


def load_result(
    load: BlockLoad,
    t0: float,
    *,
    moved: Mapping[str, int] | None = None,
    bad: Sequence[BlockId] = (),
    error: str = "",
    path: str = "",
    reads: Sequence[ReadFigures] = (),
    requested: int | None = None,
    offloaded: int = 0,
    elapsed_ms: float | None = None,
    mismatches: int = 0,
    verified: bool = False,
) -> LoadResult:
    """What ``load`` did, started at ``t0`` (``time.perf_counter()``): ``moved`` blocks per
    group, ``bad`` local ids the engine recomputes. ``requested`` defaults to every local
    block of the load; ``elapsed_ms`` to the time since ``t0``."""
    moved = dict(moved or {})
    if requested is None:
        requested = sum(len(ids) for ids in load.local_ids.values())
    if elapsed_ms is None:
        elapsed_ms = (time.perf_counter() - t0) * 1e3
    return LoadResult(
        request_id=load.request_id,
        blocks_requested=requested,
        blocks_moved=sum(moved.values()),
        bad_block_ids=tuple(bad),
        transfer_ms=elapsed_ms,
        error=error,
        moved_by_group=moved,
        path=path,
        blocks_offloaded=offloaded,
        digest_mismatches=mismatches,
        verified=verified,
        **ReadFigures.total(reads),
    )

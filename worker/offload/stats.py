"""``OffloadStats``: the offload daemon's counters (kept by its pool, read by metrics/Stats)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadStats"]


@dataclass(slots=True)
class OffloadStats:
    """Counters since the daemon started (a snapshot is a copy)."""

    capacity_blocks: int = 0
    block_bytes: int = 0
    cached_blocks: int = 0
    pinned_blocks: int = 0
    writing_blocks: int = 0
    hits: int = 0
    misses: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    aborted_stores: int = 0
    expired: int = 0
    store_seconds_sum: float = 0.0
    store_count: int = 0
    load_seconds_sum: float = 0.0
    load_count: int = 0
    quarantined_blocks: int = 0
    bad_digest_reports: int = 0
    bad_digest_blocks: int = 0
    disk_capacity_blocks: int = 0
    disk_blocks: int = 0
    disk_bytes: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    disk_evicted_blocks: int = 0
    disk_write_bytes: int = 0
    disk_read_bytes: int = 0
    disk_bad_digest_blocks: int = 0
    disk_restored_blocks: int = 0
    disk_skipped_records: int = 0

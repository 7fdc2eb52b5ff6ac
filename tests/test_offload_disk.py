"""The offload daemon's disk tier in process: file format, crash safety, rebuild, LRU.

The daemon-level tests (real daemon and NIXL worker processes, SIGKILL and restart) are in
``tests/test_offload_disk_e2e.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbridge.proto import BlockHash, ConfigError
from kvbridge.worker.offload import RECORD_BYTES, DiskTier

BLOCK = 4096
FP = b"fingerprint"


def key(i: int) -> BlockHash:
    return BlockHash(b"\x00\x00" + i.to_bytes(32, "big"))


def block(i: int) -> bytearray:
    return bytearray((i * 7 + j) % 251 for j in range(BLOCK))


def demote(tier: DiskTier, *ids: int) -> None:
    tier.put([(key(i), (i, bytes([i % 256]) * 16), [memoryview(block(i))]) for i in ids])


def read(tier: DiskTier, i: int) -> tuple[bytes, tuple[int, bytes]]:
    [(_, slot, digest)] = tier.reserve([key(i)])
    out = bytearray(BLOCK)
    tier.read([(slot, [memoryview(out)])])
    tier.settle([], [])
    return bytes(out), digest


def open_tier(path: Path, blocks: int = 4) -> DiskTier:
    return DiskTier.open(str(path), blocks * BLOCK, BLOCK, FP)


def test_blocks_are_read_back_with_their_digests_and_survive_a_reopen(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    demote(tier, 1, 2, 3)
    assert read(tier, 2) == (bytes(block(2)), (2, bytes([2]) * 16))
    tier.close()  # no orderly shutdown work: what is listed is already durable
    again = open_tier(tmp_path)
    assert again.stats.restored_blocks == 3
    assert sorted(again.keys()) == [key(1), key(2), key(3)]
    for i in (1, 2, 3):
        assert read(again, i) == (bytes(block(i)), (i, bytes([i]) * 16))


def test_lru_evicts_the_least_recently_used_and_promoted_blocks_leave(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, blocks=3)
    demote(tier, 1, 2, 3)
    read(tier, 1)  # a lookup that did not promote makes 1 the most recently used
    demote(tier, 4)
    assert tier.keys() == [key(3), key(1), key(4)]
    assert tier.stats.evicted_blocks == 1
    tier.reserve([key(3)])
    tier.settle([key(3)], [])  # promoted: gone from disk, its slot free again
    assert key(3) not in tier and len(tier) == 2
    demote(tier, 5)
    assert tier.stats.evicted_blocks == 1  # the freed slot took it
    tier.close()
    assert sorted(open_tier(tmp_path, blocks=3).keys()) == [key(1), key(4), key(5)]


def test_a_torn_record_in_the_middle_is_skipped_and_the_rest_rebuilt(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    demote(tier, 1)
    demote(tier, 2)
    demote(tier, 3)
    tier.close()
    index = tmp_path / "index"
    raw = bytearray(index.read_bytes())
    assert len(raw) == 4 * RECORD_BYTES  # header + 3 ADDs
    raw[2 * RECORD_BYTES + 40] ^= 0xFF  # block 2's record torn in the middle
    raw += b"\x01" * 50  # and a half-written record at the end
    index.write_bytes(bytes(raw))
    again = open_tier(tmp_path)
    assert sorted(again.keys()) == [key(1), key(3)]
    assert again.stats.skipped_records == 2
    assert read(again, 3)[0] == bytes(block(3))
    # the rebuilt index was rewritten compacted: a second restart sees the same
    again.close()
    assert len(index.read_bytes()) == 3 * RECORD_BYTES
    assert sorted(open_tier(tmp_path).keys()) == [key(1), key(3)]


def test_records_past_a_smaller_slab_are_skipped(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, blocks=4)
    demote(tier, 1, 2, 3, 4)
    slots = {k: s for k, s, _ in tier.reserve([key(i) for i in (1, 2, 3, 4)])}
    tier.settle([], [])
    tier.close()
    small = open_tier(tmp_path, blocks=2)
    kept = sorted(k for k, s in slots.items() if s < 2)
    assert sorted(small.keys()) == kept and small.stats.skipped_records == 2


def test_a_crash_between_data_and_index_leaves_the_old_record_naming_other_bytes(
    tmp_path: Path,
) -> None:
    """The slot's old ADD survives, but its bytes were overwritten: the digest, not the
    index, is what catches it (the daemon checks before it serves)."""
    tier = open_tier(tmp_path, blocks=1)
    demote(tier, 1)
    tier.close()
    with open(tmp_path / "slab", "r+b") as f:  # block 9's data write, then the crash
        f.write(bytes(block(9)))
    again = open_tier(tmp_path, blocks=1)
    data, digest = read(again, 1)
    assert digest == (1, bytes([1]) * 16) and data != bytes(block(1))


def test_another_layout_starts_empty(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    demote(tier, 1)
    tier.close()
    assert len(DiskTier.open(str(tmp_path), 4 * BLOCK, BLOCK, b"other")) == 0


def test_a_capacity_below_one_block_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--disk-capacity"):
        DiskTier.open(str(tmp_path), BLOCK - 1, BLOCK, FP)
    assert not os.path.exists(tmp_path / "slab")


def test_the_index_is_compacted_while_running_and_stays_correct(tmp_path: Path) -> None:
    """Demote/promote cycles append records; past 4 x capacity + 1024 the index is rewritten
    to its live records, and a reopen still finds exactly the listed blocks."""
    tier = open_tier(tmp_path, blocks=2)
    for i in range(800):  # 2 records (ADD, DEL) per cycle: 1600 appended in all
        demote(tier, i)
        tier.reserve([key(i)])
        tier.settle([key(i)], [])
    demote(tier, 5000, 5001)
    size = (tmp_path / "index").stat().st_size
    assert size < 1100 * RECORD_BYTES  # not 1 + 1600 + 2 records
    tier.close()
    again = open_tier(tmp_path, blocks=2)
    assert sorted(again.keys()) == [key(5000), key(5001)]
    assert read(again, 5001)[0] == bytes(block(5001))


def test_a_failed_write_lists_nothing_and_leaks_no_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(tmp_path, blocks=2)
    demote(tier, 1)

    def full(*_: object) -> int:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", full)
        with pytest.raises(OSError, match="No space"):
            demote(tier, 2)
    assert tier.keys() == [key(1)]
    demote(tier, 3)  # the slot the failed write took is free again: nothing is evicted
    assert sorted(tier.keys()) == [key(1), key(3)] and tier.stats.evicted_blocks == 0
    tier.close()
    assert sorted(open_tier(tmp_path, blocks=2).keys()) == [key(1), key(3)]

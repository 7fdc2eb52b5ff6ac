"""The offload daemon's disk tier: one slab file of fixed-size block slots and an append-only
index of fixed-size, self-checksummed records (``kvbridge offload serve --disk``).

Owned by :class:`kvbridge.worker.offload.tiered.TieredPool`, which calls it under its own
lock: :class:`DiskTier` is **not** thread-safe. It never touches NIXL: it copies between the
slab and memory the caller names (the daemon's registered host pool, in place).

Files under the ``--disk`` directory:

- ``slab``: ``capacity`` slots of ``block_bytes`` each; slot ``s`` starts at ``s * block_bytes``.
- ``index``: 128-byte records. The first is a header (the pool's block size and a fingerprint of
  its layout); each later record is ``ADD key slot digest`` or ``DEL key slot``, each ending in
  a CRC-32 of its own bytes. A record that fails its CRC (a torn append) is skipped.

**Crash safety**: a demotion writes the block's bytes into a free (or LRU-evicted) slot,
``fdatasync``\\ s the slab, and only then appends its ADD records and ``fsync``\\ s the index.
So an ADD that survives a crash names bytes that reached the disk before it did. A crash
between the data write and the ADD leaves the slot's *old* ADD record naming new or torn
bytes: the block's digest (kept in the record, the writer's keyed XXH3-128) no longer matches
them, and the daemon checks every block it promotes against its digest before any reader can
see it (and readers check again). A later ADD for a slot supersedes earlier ones on replay;
DEL records are written without fsync (a lost DEL only brings back a block whose bytes still
match its digest, or that a later ADD superseded).

**Restart**: :meth:`DiskTier.open` replays the index (records in order, each checked against
its CRC and its slot against the slab's size), then rewrites it compacted (live ADDs in LRU
order, written to a new file, fsynced and renamed over the old one). Another block size or
layout fingerprint starts the tier empty.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connector.events import BlockEventSink
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.types import BlockHash

__all__ = ["RECORD_BYTES", "DiskStats", "DiskTier"]

log = logging.getLogger(__name__)

Digest = tuple[int, bytes]
RECORD_BYTES = 128
MAX_KEY_BYTES = 80
_MAGIC = b"KVBD"
_OP_HEADER, _OP_ADD, _OP_DEL = 0, 1, 2
_BODY = struct.Struct(f"<4sBBHQQ16s{MAX_KEY_BYTES}s")  # magic op keylen pad slot dkey digest key
_PAD = RECORD_BYTES - _BODY.size - 4
_MAX_IOV = 512


def pack_record(op: int, key: bytes, slot: int, digest: Digest) -> bytes:
    """One index record: the body, its CRC-32, zero padding to :data:`RECORD_BYTES`."""
    body = _BODY.pack(_MAGIC, op, len(key), 0, slot, digest[0], digest[1], key)
    return body + struct.pack("<I", zlib.crc32(body)) + bytes(_PAD)


def unpack_record(raw: bytes) -> tuple[int, bytes, int, Digest] | None:
    """``(op, key, slot, digest)``, or None when the record is torn (CRC or magic wrong)."""
    body = raw[: _BODY.size]
    (crc,) = struct.unpack_from("<I", raw, _BODY.size)
    if zlib.crc32(body) != crc:
        return None
    magic, op, keylen, _, slot, dkey, digest, key = _BODY.unpack(body)
    if magic != _MAGIC or keylen > MAX_KEY_BYTES:
        return None
    return op, key[:keylen], slot, (dkey, digest)


@dataclass(slots=True)
class DiskStats:
    capacity_blocks: int = 0
    blocks: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    evicted_blocks: int = 0
    write_bytes: int = 0
    read_bytes: int = 0
    bad_digest_blocks: int = 0
    restored_blocks: int = 0
    skipped_records: int = 0


@dataclass(slots=True)
class _Entry:
    slot: int
    digest: Digest


@dataclass
class DiskTier:
    """Slots of a slab file, an LRU map ``key -> (slot, digest)`` and its durable index."""

    path: str
    capacity_blocks: int
    block_bytes: int
    events: BlockEventSink | None = None
    stats: DiskStats = field(default_factory=DiskStats)
    _lru: OrderedDict[BlockHash, _Entry] = field(default_factory=OrderedDict)
    _free: list[int] = field(default_factory=list)
    _busy: dict[BlockHash, _Entry] = field(default_factory=dict)
    _slab: int = -1
    _index: int = -1
    _records: int = 0
    _header: bytes = b""

    @classmethod
    def open(
        cls,
        path: str,
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes,
        events: BlockEventSink | None = None,
    ) -> DiskTier:
        """Open (or create) the tier under directory ``path`` and rebuild its index."""
        capacity = capacity_bytes // block_bytes
        if capacity < 1:
            raise ConfigError(
                f"--disk-capacity of {capacity_bytes} bytes holds no {block_bytes}-byte block; "
                "raise --disk-capacity"
            )
        os.makedirs(path, exist_ok=True)
        tier = cls(path, capacity, block_bytes, events)
        tier.stats.capacity_blocks = capacity
        tier._slab = os.open(os.path.join(path, "slab"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(tier._slab, capacity * block_bytes)
        header = pack_record(_OP_HEADER, fingerprint[:MAX_KEY_BYTES], block_bytes, (0, bytes(16)))
        tier._rebuild(header)
        if events is not None and tier._lru:
            events.stored(list(tier._lru))
        return tier

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def keys(self) -> list[BlockHash]:
        """Keys in LRU order, least recently used first (tests)."""
        return list(self._lru)

    # ---------------------------------------------------------------- mutations

    def put(self, blocks: Sequence[tuple[BlockHash, Digest, Sequence[memoryview]]]) -> None:
        """Demote ``(key, digest, views)`` blocks (views: the block's bytes, in span order):
        write them, fdatasync, then list them (ADD records, fsync). Evicts LRU blocks for
        room; blocks that find no slot (every slot busy) or whose key is too long are dropped."""
        placed: list[tuple[BlockHash, _Entry]] = []
        evicted: list[BlockHash] = []
        writes: list[tuple[int, Sequence[memoryview]]] = []
        for key, digest, views in blocks:
            if key in self._lru or key in self._busy or len(key) > MAX_KEY_BYTES:
                continue
            if not self._free:
                if not self._lru:
                    break
                old, entry = self._lru.popitem(last=False)
                evicted.append(old)
                self._free.append(entry.slot)
            slot = self._free.pop()
            writes.append((slot, views))
            placed.append((key, _Entry(slot, digest)))
        try:
            self._vectored(os.pwritev, writes)
            if placed:
                os.fdatasync(self._slab)
        except BaseException:
            self._free += [slot for slot, _ in writes]  # listed nowhere: reusable
            self._announce(evicted, [])
            raise
        if not placed:
            self._announce(evicted, [])
            return
        records = b"".join(pack_record(_OP_ADD, k, e.slot, e.digest) for k, e in placed)
        self._append(records, sync=True)
        for key, entry in placed:
            self._lru[key] = entry
        self.stats.demoted_blocks += len(placed)
        self.stats.write_bytes += len(placed) * self.block_bytes
        self.stats.evicted_blocks += len(evicted)
        self._announce(evicted, [k for k, _ in placed])

    def reserve(self, keys: Sequence[BlockHash]) -> list[tuple[BlockHash, int, Digest]]:
        """Take ``keys`` (those listed) out of the LRU so nothing evicts or reuses their slots
        until :meth:`settle`; returns ``(key, slot, digest)`` for each, in order."""
        out = []
        for key in keys:
            entry = self._lru.pop(key, None)
            if entry is not None:
                self._busy[key] = entry
                out.append((key, entry.slot, entry.digest))
        return out

    def read(self, reads: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """Read each ``(slot, views)``: a reserved block's bytes into ``views``, in span order
        (runs of consecutive slots in one ``preadv`` each)."""
        self._vectored(os.preadv, reads)
        self.stats.read_bytes += len(reads) * self.block_bytes

    def settle(self, promoted: Sequence[BlockHash], bad: Sequence[BlockHash]) -> None:
        """End a :meth:`reserve`: ``promoted`` and ``bad`` blocks leave the tier (DEL records,
        slots free); every other reserved block goes back, most recently used."""
        gone = [*promoted, *bad]
        records = []
        for key in gone:
            entry = self._busy.pop(key)
            self._free.append(entry.slot)
            records.append(pack_record(_OP_DEL, key, entry.slot, entry.digest))
        for key, entry in self._busy.items():
            self._lru[key] = entry
        self._busy.clear()
        if records:
            self._append(b"".join(records), sync=False)
        self.stats.promoted_blocks += len(promoted)
        self.stats.bad_digest_blocks += len(bad)
        self._announce(gone, [])

    def snapshot(self) -> DiskStats:
        s = DiskStats(**{k: getattr(self.stats, k) for k in DiskStats.__slots__})
        s.blocks = len(self._lru) + len(self._busy)
        return s

    def close(self) -> None:
        for fd in (self._slab, self._index):
            if fd >= 0:
                os.close(fd)
        self._slab = self._index = -1

    # ------------------------------------------------------------------ helpers

    def _announce(self, removed: Sequence[BlockHash], stored: Sequence[BlockHash]) -> None:
        if self.events is not None:
            if removed:
                self.events.removed(list(removed))
            if stored:
                self.events.stored(list(stored))

    def _vectored(self, call: Any, blocks: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """``os.preadv``/``os.pwritev`` of whole blocks, one call per run of consecutive slots
        (at most ``_MAX_IOV`` buffers): large sequential I/O, as a plain file copy does."""
        todo = sorted(blocks, key=lambda b: b[0])
        i = 0
        while i < len(todo):
            first, views = todo[i][0], list(todo[i][1])
            j = i + 1
            while (
                j < len(todo)
                and todo[j][0] == first + (j - i)
                and len(views) + len(todo[j][1]) <= _MAX_IOV
            ):
                views += todo[j][1]
                j += 1
            want = (j - i) * self.block_bytes
            done = call(self._slab, views, first * self.block_bytes)
            if done != want:
                raise OSError(f"short I/O on the disk tier: {done} of {want} bytes")
            i = j

    def _append(self, records: bytes, *, sync: bool) -> None:
        os.write(self._index, records)
        if sync:
            os.fsync(self._index)
        self._records += len(records) // RECORD_BYTES
        if self._records > 4 * self.capacity_blocks + 1024:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the index as its header and one ADD per listed block (LRU order, then the
        reserved ones): to a new file, fsynced, renamed over the old one, directory fsynced.
        A crash at any point leaves the old index or the new one, both complete."""
        index_path = os.path.join(self.path, "index")
        live = [*self._lru.items(), *self._busy.items()]
        tmp = index_path + ".new"
        with open(tmp, "wb") as f:
            f.write(self._header)
            f.write(b"".join(pack_record(_OP_ADD, k, e.slot, e.digest) for k, e in live))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index_path)
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if self._index >= 0:
            os.close(self._index)
        self._index = os.open(index_path, os.O_WRONLY | os.O_APPEND)
        self._records = len(live)

    def _rebuild(self, header: bytes) -> None:
        index_path = os.path.join(self.path, "index")
        raw = b""
        if os.path.exists(index_path):
            with open(index_path, "rb") as f:
                raw = f.read()
        if raw[:RECORD_BYTES] != header:
            if raw:
                log.warning(
                    "disk tier %s: another pool layout or no header; starting empty", self.path
                )
            raw = b""
        by_slot: dict[int, BlockHash] = {}
        for pos in range(RECORD_BYTES, len(raw) - RECORD_BYTES + 1, RECORD_BYTES):
            record = unpack_record(raw[pos : pos + RECORD_BYTES])
            if record is None or record[2] >= self.capacity_blocks or record[0] not in (1, 2):
                self.stats.skipped_records += 1
                continue
            op, key_bytes, slot, digest = record
            key = BlockHash(key_bytes)
            if op == _OP_ADD:
                old = by_slot.pop(slot, None)
                if old is not None:
                    self._lru.pop(old, None)
                prev = self._lru.pop(key, None)
                if prev is not None:
                    by_slot.pop(prev.slot, None)
                self._lru[key] = _Entry(slot, digest)
                by_slot[slot] = key
            elif key in self._lru and self._lru[key].slot == slot:
                del self._lru[key]
                del by_slot[slot]
        self.stats.skipped_records += (len(raw) % RECORD_BYTES != 0) if raw else 0
        used = set(by_slot)
        self._free = [s for s in range(self.capacity_blocks - 1, -1, -1) if s not in used]
        self.stats.restored_blocks = len(self._lru)
        self._header = header
        self._compact()
        if self._lru or self.stats.skipped_records:
            log.info(
                "disk tier %s: %d blocks restored, %d index records skipped",
                self.path,
                len(self._lru),
                self.stats.skipped_records,
            )

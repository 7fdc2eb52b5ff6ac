"""The offload daemon's host pool with a disk tier under it (``kvbridge offload serve --disk``).

Runs in the offload daemon, made by :class:`~kvbridge.worker.offload.handlers.OffloadHandlers`
when the config names a disk tier. :class:`TieredPool` is a :class:`HostPool` whose evictions
are *demoted* to a :class:`~kvbridge.worker.offload.disk.DiskTier` and whose lookups and loads
see both tiers; loads of disk-held blocks first *promote* them into the host pool (read into
freshly taken slots, checked against their writer's digest by the daemon, committed), then
the reader READs them over NIXL as any other block.

- **LRU across tiers**: the host pool evicts its least recently used unpinned block; it goes
  to disk as the most recently used block there; the disk evicts its own least recently used
  block for room. A promoted block leaves the disk (tiers are exclusive). Pinned blocks are
  never evicted, so never demoted.
- **Where the bytes are**: a demoted block's bytes are still in its host slot when
  ``prepare_store`` hands that slot to a new store, and its writer learns the slot only from
  the response: so the demotion (pwrite, fdatasync, index append, fsync) runs before the
  response, with the digest the pool kept. A promotion reads with ``preadv`` straight into
  the registered host slot.
- **Locking**: one lock serializes the calls that touch the disk (lookup, prepare_store,
  prepare_load); commits, aborts and completes only take the host pool's own lock.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbridge.kernels import ALGO_XXH3, span_digest
from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.layout import KVLayout
from kvbridge.proto.types import BlockHash
from kvbridge.worker.offload.config import GROUP, OffloadConfig
from kvbridge.worker.offload.disk import DiskTier
from kvbridge.worker.offload.pool import HostPool, OffloadStats, PreparedLoad, PreparedStore

if TYPE_CHECKING:
    from kvbridge.connector.events import BlockEventSink

__all__ = ["PROMOTER", "TieredPool", "block_views", "fingerprint", "open_tiered", "saved_layout"]

PROMOTER = "<disk tier>"
"""The writer name of the daemon's own promotion stores (not a valid agent name)."""
_PROMOTE_TTL_S = 60.0

log = logging.getLogger(__name__)


def block_views(layout: KVLayout, slot: int) -> list[memoryview]:
    """Slot ``slot``'s bytes in the bound ``layout``'s memory, in span order, in place."""
    import ctypes

    views = []
    for span in layout.block_spans(GROUP, slot):
        region = layout.regions[span.region]
        buf = (ctypes.c_char * span.length).from_address(region.addr + span.offset)
        views.append(memoryview(buf).cast("B"))
    return views


class TieredPool(HostPool):
    """A :class:`HostPool` over ``layout``'s bound memory with ``disk`` under it."""

    def __init__(
        self, num_blocks: int, block_bytes: int, *, disk: DiskTier, layout: KVLayout, **kw: object
    ) -> None:
        super().__init__(num_blocks, block_bytes, **kw)  # type: ignore[arg-type]
        self.disk = disk
        self._layout = layout
        self._tier_lock = threading.Lock()

    def lookup(self, keys: Iterable[BlockHash], asked: int | None = None) -> int:
        """Length of the prefix of ``keys`` held in either tier; pins and moves nothing."""
        keys = list(keys)
        with self._tier_lock:
            hits = 0
            for key in keys:
                if not (key in self.disk or self.cached(key)):
                    break
                hits += 1
        with self._lock:
            self._count_lookup(hits, len(keys) if asked is None else asked)
        return hits

    def prepare_store(
        self, keys: Sequence[BlockHash], ttl_s: float, writer: str = "", peer: str | None = None
    ) -> PreparedStore:
        """As :meth:`HostPool.prepare_store`, skipping keys the disk holds (as it skips cached
        ones); the blocks it evicts are demoted to disk before the writer learns the slots."""
        with self._tier_lock:
            fresh = [i for i, k in enumerate(keys) if k not in self.disk]
            prepared = super().prepare_store([keys[i] for i in fresh], ttl_s, writer, peer)
            self._demote(prepared, writer)
        return replace(prepared, indices=tuple(fresh[i] for i in prepared.indices))

    def prepare_load(
        self, keys: Sequence[BlockHash], ttl_s: float, writer: str = "", peer: str | None = None
    ) -> PreparedLoad:
        """As :meth:`HostPool.prepare_load`, after promoting the disk-held blocks of the prefix
        (those whose bytes fail their digest are dropped, counted, and end the prefix)."""
        with self._tier_lock:
            self._promote(keys)
            return super().prepare_load(keys, ttl_s, writer, peer)

    def stats(self) -> OffloadStats:
        s = super().stats()
        with self._tier_lock:
            d = self.disk.snapshot()
        s.disk_capacity_blocks = d.capacity_blocks
        s.disk_blocks = d.blocks
        s.disk_bytes = d.blocks * self.block_bytes
        s.demoted_blocks = d.demoted_blocks
        s.promoted_blocks = d.promoted_blocks
        s.disk_evicted_blocks = d.evicted_blocks
        s.disk_write_bytes = d.write_bytes
        s.disk_read_bytes = d.read_bytes
        s.disk_bad_digest_blocks = d.bad_digest_blocks
        s.disk_restored_blocks = d.restored_blocks
        s.disk_skipped_records = d.skipped_records
        return s

    def close(self) -> None:
        super().close()
        with self._tier_lock:
            self.disk.close()

    # ------------------------------------------------------------------ helpers

    def _demote(self, prepared: PreparedStore, writer: str) -> None:
        """Write the blocks ``prepared`` evicted to disk; if that fails, drop the store (its
        writer never learns its slots) and raise: the evicted blocks are lost, never wrong."""
        if prepared.demoted:
            try:
                # the disk index keeps XXH3 digests (the pool is host memory); a block a GPU
                # writer digested with the device algorithm is evicted, not demoted
                self.disk.put(
                    [
                        ((k, (d[0], d[1]), block_views(self._layout, b)))
                        for k, b, d in prepared.demoted
                        if d[2] in ("", ALGO_XXH3)
                    ]
                )
            except BaseException:
                if prepared.store_id:
                    self._abort(prepared.store_id, writer)
                raise

    def _promote(self, keys: Sequence[BlockHash]) -> None:
        wanted: list[BlockHash] = []
        for key in keys:
            if key in self.disk:
                wanted.append(key)
            elif not self.cached(key):
                break
        if not wanted:
            return
        entries = self.disk.reserve(wanted)
        promoted: list[BlockHash] = []
        bad: list[BlockHash] = []
        try:
            prepared = super().prepare_store([k for k, _, _ in entries], _PROMOTE_TTL_S, PROMOTER)
            self._demote(prepared, PROMOTER)
            if not prepared.store_id:
                return
            try:
                chosen = [entries[i] for i in prepared.indices]
                reads = [
                    (e[1], block_views(self._layout, b))
                    for e, b in zip(chosen, prepared.slots, strict=True)
                ]
                self.disk.read(reads)
            except BaseException:
                self._abort(prepared.store_id, PROMOTER)  # the entries stay on disk
                raise
            digests, dkeys, drop = [], [], set()
            for pos, (slot, (key, _, (dkey, digest))) in enumerate(
                zip(prepared.slots, chosen, strict=True)
            ):
                spans = self._layout.block_spans(GROUP, slot)
                if span_digest(self._layout.regions, spans, dkey) == digest:
                    promoted.append(key)
                else:
                    bad.append(key)
                    drop.add(pos)
                dkeys.append(dkey)
                digests.append(digest)
            self.mark_written(prepared.store_id, PROMOTER)
            self.commit_store(prepared.store_id, PROMOTER, dkeys, digests, drop=frozenset(drop))
        finally:
            self.disk.settle(promoted, bad)

    def _abort(self, store_id: str, writer: str) -> None:
        """Drop a store this pool made but could not hand out: its slots are free at once
        (nobody was told of them, so no WRITE can be in flight)."""
        self.mark_written(store_id, writer)
        self.abort_store(store_id, writer)


def fingerprint(layout: KVLayout) -> bytes:
    """What a disk tier's blocks mean: another fingerprint at restart starts the tier empty."""
    import hashlib

    m = layout.model
    text = (
        f"{m.name}|{m.dtype}|{m.num_layers}|{m.num_kv_heads}|{m.head_size}|{layout.block_size}|"
        f"{layout.tp_size}|{' '.join(layout.order)}|{layout.block_bytes(GROUP)}"
    )
    # groups of their own page shape (a hybrid model's), only where there are any: a uniform
    # layout's tier keeps the fingerprint it was saved under
    text += "".join(f"|{g.name}:{g.page.describe()}" for g in layout.groups if g.page is not None)
    return hashlib.sha256(text.encode()).digest()


def open_tiered(
    layout: KVLayout,
    config: OffloadConfig,
    knobs: Mapping[str, object],
    disk_events: Callable[[int], BlockEventSink] | None,
) -> TieredPool:
    """The daemon's pool over bound ``layout`` with the disk tier ``config`` names, its index
    rebuilt from what an earlier run left there."""
    assert config.disk_path is not None
    block_bytes = layout.block_bytes(GROUP)
    disk = DiskTier.open(
        config.disk_path,
        config.disk_capacity_bytes,
        block_bytes,
        fingerprint(layout),
        None if disk_events is None else disk_events(layout.block_size),
    )
    save_layout(config.disk_path, layout)
    num_blocks = layout.group(GROUP).num_blocks
    return TieredPool(num_blocks, block_bytes, disk=disk, layout=layout, **knobs)


def save_layout(path: str, layout: KVLayout) -> None:
    """Keep the pool's layout next to the disk tier, so a restarted daemon makes its pool (and
    serves the disk) at start, before any worker's handshake (:func:`saved_layout`)."""
    tmp = os.path.join(path, "layout.new")
    with open(tmp, "wb") as f:
        f.write(layout.to_bytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, "layout"))


def saved_layout(path: str) -> KVLayout | None:
    """The layout an earlier run kept under ``path``; None if none (or unreadable: logged)."""
    try:
        with open(os.path.join(path, "layout"), "rb") as f:
            return KVLayout.from_bytes(f.read())
    except FileNotFoundError:
        return None
    except (OSError, KVBridgeError) as exc:
        log.warning("disk tier %s: its saved pool layout is unreadable (%s); ignored", path, exc)
        return None

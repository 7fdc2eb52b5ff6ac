"""The offload daemon's host pool bookkeeping: which slot holds which block hash.

Owned by the daemon's servicer (:mod:`kvbridge.worker.offload.server`) and called from its
threads, so every method takes the pool's lock. Pure bookkeeping over a :class:`BlockPool`: no
memory, no NIXL (disk tier: :mod:`kvbridge.worker.offload.tiered`). Keys: ``(tp_rank, hash)``.

Every store and load belongs to a **writer** (the NIXL agent name of the session that made it,
:mod:`kvbridge.worker.offload.writers`) and is charged to a **peer** (the caller's
authenticated identity): only that writer and peer end it, a store commits only after
:meth:`HostPool.mark_written`, and each peer, under any number of agent names, holds at most
``max_stores_per_writer`` stores and ``max_pinned_per_writer`` pinned blocks. Slot states and
the **digest** each committed block keeps: :mod:`kvbridge.worker.offload.slots`;
:meth:`HostPool.drop_bad` drops a reported block only if the daemon's own check agrees.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvbridge.connector.events import BlockEventSink
from kvbridge.proto.errors import ConfigError, LeaseError, WireError
from kvbridge.proto.types import BlockHash, BlockId
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.offload.quotas import Quotas, lease_gone
from kvbridge.worker.offload.slots import (
    Confirm,
    Digest,
    Pending,
    PreparedLoad,
    PreparedStore,
    Quarantine,
    checked_digests,
    pool_key,
)
from kvbridge.worker.offload.stats import OffloadStats

__all__ = ["Digest", "HostPool", "OffloadStats", "PreparedStore", "PreparedLoad", "pool_key"]

log = logging.getLogger(__name__)


class HostPool:
    """Slot bookkeeping for ``num_blocks`` host blocks of ``block_bytes`` each."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = 4096,
        max_stores_per_writer: int = 64,
        max_pinned_per_writer: int | None = None,
        events: BlockEventSink | None = None,
        grace_s: float = 0.0,
    ) -> None:
        for knob, value in (("block_bytes", block_bytes), ("max_pending", max_pending)):
            if value < 1:
                raise ConfigError(f"{knob} must be >= 1, got {value}")
        self._evicted: list[tuple[BlockHash, BlockId]] = []
        on_evict = lambda h, b: self._evicted.append((h, b))  # noqa: E731 (self._evicted rebound)
        self._pool = BlockPool(num_blocks, on_evict=on_evict, events=events)
        self._block_bytes = block_bytes
        self._clock = clock
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._writing: dict[BlockHash, str] = {}  # key -> store id
        self._stores: dict[str, Pending] = {}
        self._loads: dict[str, Pending] = {}
        self._pinned = 0
        pin_cap = num_blocks if max_pinned_per_writer is None else max_pinned_per_writer
        self._quotas = Quotas(max_stores_per_writer, pin_cap)
        self._stats = OffloadStats(capacity_blocks=num_blocks, block_bytes=block_bytes)
        self._quarantine = Quarantine(grace_s, limit=num_blocks // 4)
        self._digests: list[Digest | None] = [None] * num_blocks  # per slot, set at commit

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Iterable[BlockHash], asked: int | None = None) -> int:
        """Length of the committed prefix of ``keys``; counts hits and misses, pins nothing.

        ``keys`` may be a lazy iterable (read up to the first miss); then pass
        ``asked``, its length, for the miss count.
        """
        if asked is None:
            keys = list(keys)
            asked = len(keys)
        with self._lock:
            hits = 0
            for key in keys:
                if self._pool.get_block(key) is None:
                    break
                hits += 1
            self._count_lookup(hits, asked)
            return hits

    def cached(self, key: BlockHash) -> bool:
        with self._lock:  # is ``key`` committed in the pool? (counts nothing)
            return self._pool.get_block(key) is not None

    def stats(self) -> OffloadStats:
        with self._lock:
            s = self._stats
            snapshot = OffloadStats(**{k: getattr(s, k) for k in OffloadStats.__slots__})
            snapshot.cached_blocks = self._pool.num_cached_blocks
            snapshot.pinned_blocks = self._pinned
            snapshot.writing_blocks = len(self._writing)
            snapshot.quarantined_blocks = len(self._quarantine)
            return snapshot

    def check(self) -> None:
        """Assert the invariants (tests): every slot is counted once, capacity is respected."""
        with self._lock:
            writing = sum(len(p.slots) for p in self._stores.values())
            pinned = sum(len(p.slots) for p in self._loads.values())
            assert writing == len(self._writing)
            assert pinned == self._pinned
            referenced = self._pool.num_blocks - self._pool.num_free_blocks
            held = self._quarantine.slots()
            store_slots = {b for p in self._stores.values() for b in p.slots}
            pinned_slots = {b for p in self._loads.values() for b in p.slots}
            assert len(set(held)) == len(held) and not set(held) & store_slots
            assert len(store_slots) == writing
            assert writing + len(held) + len(pinned_slots) <= referenced
            assert all(self._pool.block_hash(b) is None for b in held)
            assert self._pool.num_cached_blocks + writing <= self._pool.num_blocks
            stores = Counter(p.peer for p in self._stores.values())
            pins = Counter(p.peer for p in self._loads.values() for _ in p.slots)
            assert stores == self._quotas.stores and pins == self._quotas.pins

    def pending_of(self, peer: str) -> tuple[int, int]:
        """``(prepared stores, pinned blocks)`` charged to ``peer`` (or writer) now."""
        with self._lock:
            return self._quotas.of(peer)

    # ---------------------------------------------------------------- mutations

    def prepare_store(
        self, keys: Sequence[BlockHash], ttl_s: float, writer: str = "", peer: str | None = None
    ) -> PreparedStore:
        """Take slots for the keys neither cached nor being written, in order, while room lasts.

        Evicts least recently used unpinned blocks as needed; returns their keys.
        Raises ``RESOURCE_EXHAUSTED`` when ``peer`` (default: ``writer``) already holds its
        cap of stores.
        """
        peer = writer if peer is None else peer
        self._expire()
        with self._lock:
            self._quotas.take_store(peer)  # counted now, given back below if nothing to do
            seen: set[BlockHash] = set()
            wanted: list[int] = []
            for i, key in enumerate(keys):
                if key in seen or key in self._writing or self._pool.get_block(key) is not None:
                    continue
                seen.add(key)
                wanted.append(i)
            take = min(len(wanted), self._pool.num_free_blocks)
            if take == 0 or len(self._stores) >= self._max_pending:
                self._quotas.drop_store(peer)
                return PreparedStore("", (), (), (), 0.0)
            wanted = wanted[:take]
            # ascending (the free queue holds them reversed): NIXL merges adjacent ones
            slots = sorted(self._pool.allocate(take))
            evicted, self._evicted = self._evicted, []
            store_id = secrets.token_hex(16)
            now = self._clock()
            chosen = [keys[i] for i in wanted]
            self._stores[store_id] = Pending(list(slots), chosen, now, now + ttl_s, writer, peer)
            for key in chosen:
                self._writing[key] = store_id
            self._stats.evicted_blocks += len(evicted)
            self._stats.evicted_bytes += len(evicted) * self._block_bytes
            demoted = tuple((k, b, self._digest_of(b)) for k, b in evicted)
        gone = tuple(k[2:] for k, _ in evicted)
        return PreparedStore(store_id, tuple(wanted), tuple(slots), gone, ttl_s, demoted)

    def mark_written(self, store_id: str, writer: str) -> bool:
        """Record that ``writer``'s WRITE into the store completed; False (nothing changes)
        if the store is unknown or belongs to another writer."""
        with self._lock:
            pending = self._stores.get(store_id)
            if pending is None or pending.writer != writer:
                return False
            pending.written = True
            return True

    def commit_store(
        self,
        store_id: str,
        writer: str = "",
        key: int | Sequence[int] = 0,
        digests: Sequence[bytes] = (),
        algo: str = "",
        peer: str | None = None,
        drop: frozenset[int] = frozenset(),
    ) -> int:
        """Publish a store's blocks (they become visible and evictable); returns how many.

        Only ``writer`` and ``peer`` (default: ``writer``), the store's own, may commit it,
        and only once its WRITE was marked done (:meth:`mark_written`); otherwise this
        raises and changes nothing. ``digests`` (one per slot, in slot order, keyed with
        ``key``, of algorithm ``algo``, empty: XXH3) are what readers will check; a count,
        size or algorithm that does not fit raises :class:`WireError` and changes nothing.
        (Promotions: a key per slot; ``drop`` unpublished.)
        """
        self._expire()
        with self._lock:
            pending = self._stores.get(store_id)
            if pending is None or not pending.owned_by(writer, peer):
                raise lease_gone("store", store_id)
            if not pending.written:
                err = LeaseError(
                    f"store {store_id!r} has no completed WRITE yet: WRITE its slots with the "
                    "store's notification, then commit"
                )
                err.code = "FAILED_PRECONDITION"
                raise err
            kept = checked_digests(key, digests, algo, len(pending.slots))
            del self._stores[store_id]
            self._quotas.drop_store(pending.peer)
            for i, (slot, block_key, digest) in enumerate(
                zip(pending.slots, pending.keys, kept, strict=True)
            ):
                del self._writing[block_key]
                if i in drop:
                    continue
                self._digests[slot] = digest
                cached = self._pool.cache_block(slot, block_key)
                assert cached, "a key being written is never cached by anyone else"
            self._pool.free(pending.slots)
            n = len(pending.slots) - len(drop)
            self._stats.stored_blocks += n
            self._stats.stored_bytes += n * self._block_bytes
            self._stats.store_seconds_sum += self._clock() - pending.started
            self._stats.store_count += 1
        return n

    def abort_store(self, store_id: str, writer: str = "", peer: str | None = None) -> bool:
        """Free a store's slots unpublished; False if it was unknown, already finished, or
        not ``writer``'s and ``peer``'s."""
        self._expire()
        with self._lock:
            pending = self._stores.get(store_id)
            if pending is None or not pending.owned_by(writer, peer):
                return False
            del self._stores[store_id]
            self._drop_store(pending, self._clock())
            self._stats.aborted_stores += 1
        return True

    def prepare_load(
        self, keys: Sequence[BlockHash], ttl_s: float, writer: str = "", peer: str | None = None
    ) -> PreparedLoad:
        """Pin the committed prefix of ``keys`` until :meth:`complete_load` or expiry.

        ``peer`` (default: ``writer``) pins at most ``max_pinned_per_writer`` blocks at
        once: a longer hit is cut to the room left; none left raises ``RESOURCE_EXHAUSTED``.
        """
        peer = writer if peer is None else peer
        self._expire()
        with self._lock:
            hits = self._pool.lookup_prefix(keys)
            self._count_lookup(len(hits), len(keys))
            if not hits or len(self._loads) >= self._max_pending:
                return PreparedLoad("", (), 0.0)
            hits = hits[: self._quotas.pin_room(peer)]
            self._pool.touch(hits)
            self._pinned += len(hits)
            self._quotas.pin(peer, len(hits))
            load_id = secrets.token_hex(16)
            now = self._clock()
            self._loads[load_id] = Pending(
                list(hits), list(keys[: len(hits)]), now, now + ttl_s, writer, peer
            )
            digests = tuple(self._digest_of(b) for b in hits)
        return PreparedLoad(load_id, tuple(hits), ttl_s, digests)

    def drop_bad(
        self,
        load_id: str,
        writer: str,
        bad: Sequence[int],
        confirm: Confirm,
        peer: str | None = None,
    ) -> int:
        """Drop from the index the blocks of the load (``writer``'s and ``peer``'s) at
        positions ``bad`` (failing the reader's digest check) that ``confirm`` also finds bad:
        a report is a claim, ``confirm`` recomputes each digest over the daemon's memory.
        Returns how many were dropped (0 if the load is gone or not the caller's). Positions
        out of range or repeated raise :class:`WireError` and change nothing."""
        with self._lock:
            pending = self._loads.get(load_id)
            if pending is None or not pending.owned_by(writer, peer):
                return 0
            if any(not 0 <= i < len(pending.slots) for i in bad) or len(set(bad)) != len(bad):
                last = len(pending.slots) - 1
                raise WireError(f"CompleteLoad names bad positions outside 0..{last} or twice")
            dropped = 0
            for i in bad:
                slot = pending.slots[i]
                if self._pool.block_hash(slot) != pending.keys[i]:
                    continue  # already dropped (another reader's confirmed report)
                if not confirm(slot, self._digest_of(slot)):
                    self._pool.uncache(slot)
                    self._digests[slot] = None
                    dropped += 1
            self._stats.bad_digest_reports += len(bad)
            self._stats.bad_digest_blocks += dropped
            return dropped

    def complete_load(self, load_id: str, writer: str = "", peer: str | None = None) -> bool:
        """Unpin a load's blocks (they move to the most recently used end); False if gone
        or not ``writer``'s and ``peer``'s."""
        self._expire()
        with self._lock:
            pending = self._loads.get(load_id)
            if pending is None or not pending.owned_by(writer, peer):
                return False
            del self._loads[load_id]
            self._unpin(pending)
            n = len(pending.slots)
            self._stats.loaded_blocks += n
            self._stats.loaded_bytes += n * self._block_bytes
            self._stats.load_seconds_sum += self._clock() - pending.started
            self._stats.load_count += 1
        return True

    def expire(self) -> int:
        """Abort stores and unpin loads past their expiry; returns how many."""
        return self._expire()

    def close(self) -> None:
        """Drop every pending store and load (the daemon is stopping)."""
        with self._lock:
            for pending in self._stores.values():
                self._drop_store(pending, None)
            for pending in self._loads.values():
                self._unpin(pending)
            self._stores.clear()
            self._loads.clear()
            self._pool.free(self._quarantine.drain())
            self._quotas.clear()

    # ------------------------------------------------------------------ helpers

    def _expire(self) -> int:
        with self._lock:
            now = self._clock()
            stores = [k for k, p in self._stores.items() if p.expires_at <= now]
            loads = [k for k, p in self._loads.items() if p.expires_at <= now]
            for store_id in stores:
                log.info("store %s expired before commit; its slots are freed", store_id)
                self._drop_store(self._stores.pop(store_id), now)
            for load_id in loads:
                log.info("load %s expired before completion; its blocks are unpinned", load_id)
                self._unpin(self._loads.pop(load_id))
            self._stats.expired += len(stores) + len(loads)
            self._pool.free(self._quarantine.due(now))
            return len(stores) + len(loads)

    def _drop_store(self, pending: Pending, now: float | None) -> None:
        """Forget an uncommitted store. Its slots are free at once if its WRITE completed
        (or the daemon is closing: ``now`` None), else quarantined for ``grace_s``: a WRITE
        still in flight must not land on a block another store committed meanwhile."""
        for key in pending.keys:
            del self._writing[key]
        if pending.written or now is None:
            self._pool.free(pending.slots)
        else:
            self._pool.free(self._quarantine.hold(now, pending.slots))
        self._quotas.drop_store(pending.peer)

    def _digest_of(self, slot: BlockId) -> Digest:
        digest = self._digests[slot]
        assert digest is not None, "every committed block has its writer's digest"
        return digest

    def _unpin(self, pending: Pending) -> None:
        self._pool.free(pending.slots)
        self._pinned -= len(pending.slots)
        self._quotas.unpin(pending.peer, len(pending.slots))

    def _count_lookup(self, hits: int, asked: int) -> None:
        self._stats.hits += hits
        self._stats.misses += asked - hits

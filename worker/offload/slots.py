"""What the offload daemon's host pool hands out and keeps per slot (see ``pool``).

Plain records of the pool (:mod:`kvbridge.worker.offload.pool`): prepared
stores and loads, the pending entries it tracks, its keys, and the per-slot
digests readers check.

Every committed block carries its writer's **digest**: a 64-bit key and a
16-byte keyed XXH3-128 of its bytes, sent in CommitStore and kept in the
daemon's own memory, never in NIXL-registered memory (which any peer with the
daemon's agent metadata can write). PrepareLoad hands them to the reader with
the slots. A reader that finds a block's bytes do not match names it; the
daemon drops the block from its index only if its own recomputation agrees: a
reader's report is a claim, never enough on its own to evict a block.

The pool's slot states (methods of ``HostPool``):

- **free**: ref count 0, maybe with a hash (evictable, LRU order);
- **writing**: taken by ``prepare_store``, ref count 1, *no hash in the block pool*:
  invisible to lookups and loads, never evicted. ``commit_store`` caches it under its hash
  and drops the reference (it becomes evictable); an abort (``abort_store``) or the store's
  expiry (a dead writer) frees it without a hash;
- **quarantined**: a slot of a store aborted or expired *before its WRITE completed* (that
  WRITE may still land: nothing revokes it) stays out of the free list for ``grace_s``
  seconds, up to a quarter of the pool; a written store's slots (and any past that quarter)
  are freed at once;
- **pinned**: a committed block with references from loads (``prepare_load`` /
  ``complete_load``), never evicted while pinned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.kernels.digest import ALGO_DEVICE, ALGO_XXH3
from kvbridge.proto.errors import ConfigError, WireError
from kvbridge.proto.types import BlockHash, BlockId

__all__ = [
    "DIGEST_BYTES",
    "Confirm",
    "Digest",
    "Pending",
    "PreparedLoad",
    "PreparedStore",
    "Quarantine",
    "checked_digests",
    "pool_key",
]

DIGEST_BYTES = 16
Digest = tuple[int, bytes, str]
"""A committed block's ``(key, digest, algo)``: its writer's keyed digest and the algorithm
(:mod:`kvbridge.kernels.digest`) it used, so a reader computes the same one."""
Confirm = Callable[[BlockId, Digest], bool]
"""``confirm(slot, digest)``: True if the slot's bytes (in the daemon's memory) still match."""


def pool_key(tp_rank: int, block_hash: bytes) -> BlockHash:
    """The pool's key of ``block_hash`` for ``tp_rank`` (2-byte rank prefix)."""
    return BlockHash(tp_rank.to_bytes(2, "big") + block_hash)


@dataclass(frozen=True, slots=True)
class PreparedStore:
    """Slots to WRITE: ``hashes[indices[i]]`` goes into ``slots[i]``. Empty id: nothing to do."""

    store_id: str
    indices: tuple[int, ...]
    slots: tuple[BlockId, ...]
    evicted: tuple[bytes, ...]
    expires_in_s: float
    demoted: tuple[tuple[BlockHash, BlockId, Digest], ...] = ()
    """Evicted committed blocks as ``(key, slot, digest)``: their bytes stay in ``slot`` until
    the store's writer WRITEs it (the disk tier copies them out first)."""


@dataclass(frozen=True, slots=True)
class PreparedLoad:
    """Pinned slots of the cached prefix; empty id: no hit, nothing to complete."""

    load_id: str
    slots: tuple[BlockId, ...]
    expires_in_s: float
    digests: tuple[Digest, ...] = ()
    """Per slot, its writer's ``(key, digest)``."""


@dataclass(slots=True)
class Pending:
    """A prepared store or load, as the pool tracks it."""

    slots: list[BlockId]
    keys: list[BlockHash]
    started: float
    expires_at: float
    writer: str = ""
    """The NIXL agent name of the session that made it (its WRITE notifications come from
    that agent)."""
    peer: str = ""
    """The authenticated identity charged for it (``caller_identity``): the caps count this,
    and only a session of this peer *and* this agent may end it."""
    written: bool = False
    """A store: its writer's WRITE-completion notification arrived."""

    def owned_by(self, writer: str, peer: str | None) -> bool:
        """Whether a session of ``writer`` (agent name) and ``peer`` (identity; None: the
        writer's name, as when it was made without one) may end it."""
        return self.writer == writer and self.peer == (writer if peer is None else peer)


class Quarantine:
    """Slots of stores dropped before their WRITE completed, held ``grace_s`` seconds (a late
    WRITE may still land in them) before they go back to the free list; not thread-safe.

    At most ``limit`` slots are held at once: past that a dropped store's slots are free at
    once (readers' digest checks still catch a late WRITE), so a worker that prepares and
    abandons stores cannot keep more than ``limit`` slots of the pool out of use."""

    def __init__(self, grace_s: float, limit: int) -> None:
        if not 0 <= grace_s < float("inf"):
            raise ConfigError(f"grace_s must be finite and >= 0, got {grace_s}")
        self.grace_s = grace_s
        self.limit = limit
        self._count = 0
        self._held: list[tuple[float, list[BlockId]]] = []  # (free at, slots), oldest first

    def __len__(self) -> int:
        return self._count

    def hold(self, now: float, slots: Sequence[BlockId]) -> list[BlockId]:
        """Hold what fits under the limit; returns the slots to free now."""
        if self.grace_s == 0:
            return list(slots)
        room = max(0, self.limit - self._count)
        kept, rest = list(slots[:room]), list(slots[room:])
        if kept:
            self._held.append((now + self.grace_s, kept))
            self._count += len(kept)
        return rest

    def due(self, now: float) -> list[BlockId]:
        """Take the slots whose grace is over."""
        out: list[BlockId] = []
        while self._held and self._held[0][0] <= now:
            out += self._held.pop(0)[1]
        self._count -= len(out)
        return out

    def drain(self) -> list[BlockId]:
        """Take every held slot (the daemon is stopping)."""
        out = self.slots()
        self._held.clear()
        self._count = 0
        return out

    def slots(self) -> list[BlockId]:
        return [b for _, slots in self._held for b in slots]


def checked_digests(
    key: int | Sequence[int], digests: Sequence[bytes], algo: str, slots: int
) -> list[Digest]:
    """A CommitStore's digests as the pool keeps them, one per slot; a count, size or
    algorithm that does not fit raises :class:`WireError` (empty ``algo``: XXH3)."""
    algo = algo or ALGO_XXH3
    if algo not in (ALGO_XXH3, ALGO_DEVICE):
        raise WireError(f"CommitStore names digest algorithm {algo!r}: not one this daemon knows")
    if len(digests) != slots or any(len(d) != DIGEST_BYTES for d in digests):
        raise WireError(
            f"CommitStore carries {len(digests)} digests for {slots} slots: "
            f"send one {DIGEST_BYTES}-byte digest per slot"
        )
    keys = [key] * slots if isinstance(key, int) else list(key)
    if len(keys) != slots:
        raise WireError(f"{len(keys)} digest keys for {slots} slots")
    return [(k, bytes(d), algo) for k, d in zip(keys, digests, strict=True)]

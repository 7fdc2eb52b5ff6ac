"""Block tables of the reference scheduler: how many blocks a request needs, whether they
fit, and its cross-attention table.

**Cross-attention blocks** (encoder-decoder). A request with an encoder
input gets one cross block table (``ceil(encoder_len / block_size)`` blocks of
the ``cross`` group), named by
:meth:`~kvbridge.proto.hashing.BlockHasher.cross_block_hashes`. Admission takes
them from the prefix cache when *all* are cached (a partial set is never
used); otherwise it allocates fresh ones, which the connector may load (it
names them in ``update_state_after_alloc``'s ``block_ids["cross"]``, which is
present only when the request still needs its cross KV) or which the first
chunk fills by running the encoder. Any load error of such a request makes it
recompute its cross KV as well (fail closed). They are cached once written and
freed with the request. The decoder's self-attention KV depends on the encoder
input, so the encoder input hash is an extra key of the self blocks' names.

Every function that touches a pool is called with :attr:`Scheduler.lock` held.
"""

from __future__ import annotations

from kvbridge.proto.types import BlockId
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.engine.request import Request

__all__ = [
    "allocate_cross",
    "blocks_needed",
    "cache_cross",
    "cross_fits",
    "fits",
]


def blocks_needed(num_prompt: int, max_tokens: int, block_size: int) -> int:
    """The whole block table of a request: the last sampled token's KV is never written."""
    return -(-(num_prompt + max_tokens - 1) // block_size)


def fits(pool: BlockPool, hits: list[BlockId], need: int) -> bool:
    """Whether ``need`` blocks can be had with ``hits`` reused (free hits count once)."""
    free_hits = sum(1 for b in hits if pool.ref_count(b) == 0)
    return pool.num_free_blocks - free_hits >= need - len(hits)


def _cross_hits(pool: BlockPool, request: Request) -> list[BlockId]:
    """The request's cross blocks if *all* of them are cached, else []."""
    hits = pool.lookup_prefix(request.cross_hashes)
    return hits if len(hits) == len(request.cross_hashes) else []


def cross_fits(pool: BlockPool | None, request: Request) -> bool:
    """Whether the request's cross blocks can be had now (true without an encoder input)."""
    if not request.cross_hashes:
        return True
    assert pool is not None, "a request with cross hashes in an engine without a cross group"
    return fits(pool, _cross_hits(pool, request), len(request.cross_hashes))


def allocate_cross(pool: BlockPool | None, request: Request) -> None:
    """Take the cached cross blocks (all of them) or allocate fresh ones."""
    if not request.cross_hashes:
        return
    assert pool is not None, "a request with cross hashes in an engine without a cross group"
    hits = _cross_hits(pool, request)
    if hits:
        pool.touch(hits)
        request.cross_block_ids = hits
        request.cross_ready = True
        request.cross_source = "hit"
    else:
        request.cross_block_ids = pool.allocate(len(request.cross_hashes))


def cache_cross(pool: BlockPool, request: Request, source: str) -> None:
    """The request's cross blocks now hold its cross K/V: cache them under their names."""
    for block_id, block_hash in zip(request.cross_block_ids, request.cross_hashes, strict=True):
        pool.cache_block(block_id, block_hash)
    request.cross_ready = True
    request.cross_loading = False
    request.cross_source = source

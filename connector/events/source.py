"""``BlockEventSink``: what a block cache tells about the hashes it holds, and the
``KVEventSource`` that turns it into vLLM KV events.

A block cache (the reference engine's prefix cache, the offload daemon's host pool)
calls its sink from its single owner's thread (under its lock): :meth:`stored` when a
hash becomes visible to lookups, :meth:`removed` when it stops being visible (evicted,
uncached, reset), :meth:`cleared` when it starts empty. The sink never blocks and never
raises into the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from kvbridge.connector.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)

__all__ = ["BlockEventSink", "KVEventSource"]


class _Publisher(Protocol):
    def publish(self, events: Sequence[KVEvent]) -> None: ...


class BlockEventSink(ABC):
    """Told by a block cache's owner, from its thread, whenever a cached hash comes or goes."""

    @abstractmethod
    def stored(self, block_hashes: Sequence[bytes]) -> None:
        """These hashes are now cached (lookups can hit them)."""

    @abstractmethod
    def removed(self, block_hashes: Sequence[bytes]) -> None:
        """These hashes are no longer cached."""

    @abstractmethod
    def cleared(self) -> None:
        """The cache holds nothing (it was just made or wiped)."""


class KVEventSource(BlockEventSink):
    """One cache's events, all with one ``medium``, handed to a publisher.

    ``key_prefix`` bytes are cut off every key first: the offload daemon's keys carry a
    2-byte tensor-parallel rank before the block hash. Each :meth:`stored` call becomes
    one ``BlockStored`` (no parent hash and no token ids: a cache keyed by hash alone
    does not know them), each :meth:`removed` call one ``BlockRemoved``.
    """

    def __init__(
        self,
        publisher: _Publisher,
        *,
        medium: str,
        block_size: int,
        wire: str,
        key_prefix: int = 0,
        group_idx: int | None = None,
    ) -> None:
        self._publisher = publisher
        self.medium = medium
        self.block_size = block_size
        self._wire = wire
        self._cut = key_prefix
        self._group = group_idx

    def stored(self, block_hashes: Sequence[bytes]) -> None:
        if block_hashes:
            hashes = tuple(external_hash(h[self._cut :], self._wire) for h in block_hashes)
            event = BlockStored(
                hashes, None, (), self.block_size, None, self.medium, None, self._group
            )
            self._publisher.publish((event,))

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        if block_hashes:
            hashes = tuple(external_hash(h[self._cut :], self._wire) for h in block_hashes)
            self._publisher.publish((BlockRemoved(hashes, self.medium, self._group),))

    def cleared(self) -> None:
        self._publisher.publish((AllBlocksCleared(),))

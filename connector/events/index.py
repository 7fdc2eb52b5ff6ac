"""``PrefixIndex``: which node holds which block hashes, built from KV events.

Fed by subscribers (one stream per node and cache), read by routers: the longest run
of a request's leading block hashes a node holds says how much of its prompt that node
would not recompute. It is advice for placement only; the node that serves the request
still decides by its own cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvbridge.connector.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalHash,
)

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Per node, per medium, the set of hashes its events say it holds; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[str | None, set[ExternalHash]]] = {}

    def apply(self, node: str, batch: EventBatch) -> None:
        with self._lock:
            media = self._held.setdefault(node, {})
            for event in batch.events:
                if isinstance(event, BlockStored):
                    media.setdefault(event.medium, set()).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    media.get(event.medium, set()).difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    media.clear()

    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def holds(self, node: str, medium: str | None = None) -> set[ExternalHash]:
        """Hashes ``node`` holds (in ``medium``, or in any)."""
        with self._lock:
            media = self._held.get(node, {})
            if medium is not None:
                return set(media.get(medium, ()))
            return set().union(*media.values()) if media else set()

    def prefix_len(self, node: str, hashes: Sequence[ExternalHash]) -> int:
        """Leading ``hashes`` that ``node`` holds in any medium."""
        with self._lock:
            media = list(self._held.get(node, {}).values())
            n = 0
            for h in hashes:
                if not any(h in held for held in media):
                    break
                n += 1
            return n

    def best(self, nodes: Iterable[str], hashes: Sequence[ExternalHash]) -> tuple[str, int] | None:
        """The node with the longest held prefix (first listed on a tie); None if none
        holds the first block."""
        best: tuple[str, int] | None = None
        for node in nodes:
            n = self.prefix_len(node, hashes)
            if n > 0 and (best is None or n > best[1]):
                best = (node, n)
        return best

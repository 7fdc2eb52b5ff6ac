"""One load under way: what it reads, what it holds that a failure must give back, and when
it passed each of its steps.

Made by :class:`~kvbridge.connector.load.RemoteLoader` for a load on a pool thread and by
:func:`~kvbridge.connector.load.inline.start_inline` for one driven from the engine's thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.load.verify import Expected
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId, LeaseId

if TYPE_CHECKING:
    from kvbridge.connector.load.links import Peer

__all__ = ["Attempt"]


@dataclass(slots=True)
class Attempt:
    """One load under way: what it reads, and what it holds that a failure must give back."""

    load: BlockLoad
    t0: float = field(default_factory=time.perf_counter)
    local: dict[KVGroup, list[BlockId]] = field(init=False)
    remote: dict[KVGroup, list[BlockId]] = field(init=False)
    peer: Peer | None = None
    cached: bool = False
    """Whether ``peer`` came from the link cache (it may be to a process since restarted)."""
    link_ms: float = 0.0
    """How long this load waited for a new link (handshake and warm-up); 0 when cached."""
    lease: LeaseId | None = None
    """The lease the owner named for this load: the only lease this load may release (the
    lease id in the params is a claim, maybe another request's)."""
    expected: Expected | None = field(init=False)
    """The digests the blocks must match (None: the load is not verified)."""
    steps: list[tuple[str, float]] = field(init=False)
    """``(step, time.perf_counter())`` as the load passed each step (the debug step timing)."""

    def __post_init__(self) -> None:
        load = self.load
        self.expected = Expected.of(load)
        groups = [g for g, ids in load.local_ids.items() if ids]
        self.local = {g: list(load.local_ids[g]) for g in groups}
        self.remote = {g: list(load.remote_ids.get(g, ())) for g in groups}
        self.steps = [("start", self.t0)]

    def mark(self, step: str) -> None:
        self.steps.append((step, time.perf_counter()))

    def done(self, result: LoadResult) -> LoadResult:
        """``result`` with this load's link time and steps."""
        self.mark("verdict")
        steps = tuple(sorted((*result.steps, *self.steps), key=lambda step: step[1]))
        return replace(result, link_ms=self.link_ms or result.link_ms, steps=steps)

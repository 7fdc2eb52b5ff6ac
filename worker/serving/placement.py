"""``EventPlacement``: the router's option to send a prompt to the prefill node whose
KV events show the longest cached prefix of it.

One thread subscribes to every prefill node's KV events (``kvbridge serve --kv-events``)
and keeps a :class:`~kvbridge.connector.events.PrefixIndex`. :meth:`prefer` hashes the
prompt the way the nodes do and names the node holding the longest run of its leading
blocks. It only changes *where* a request goes: the node still decides from its own
cache, so a stale or wrong index costs recomputation, never a wrong token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from kvbridge.connector.events import (
    WIRE_VLLM,
    EventSubscriber,
    KVEventsError,
    PrefixIndex,
    external_hash,
)

__all__ = ["EventPlacement", "EventStream"]

log = logging.getLogger(__name__)

EventStream = tuple[str, str | None]
"""A node's KV events: (PUB endpoint to connect to, replay endpoint or None)."""


class EventPlacement:
    """Prefix-aware choice among the router's prefill nodes, by their KV events.

    ``streams[i]`` is the event stream of the router's ``i``-th prefill node;
    ``block_hashes(prompt)`` names the prompt's full blocks as the nodes do (their
    ``BlockHasher``); ``wire`` is the nodes' ``--kv-events-wire``.
    """

    def __init__(
        self,
        streams: Sequence[EventStream],
        block_hashes: Callable[[Sequence[int]], Sequence[bytes]],
        *,
        wire: str = WIRE_VLLM,
        topic: str = "",
    ) -> None:
        self.index = PrefixIndex()
        self._hash = block_hashes
        self._wire = wire
        self._subs: list[EventSubscriber] = []
        try:
            for endpoint, replay in streams:
                self._subs.append(
                    EventSubscriber(endpoint, replay_endpoint=replay, topic=topic, from_seq=0)
                )
        except BaseException:
            self.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-placement", daemon=True)
        self._thread.start()

    def prefer(self, prompt: Sequence[int]) -> int | None:
        """The prefill node (index) with the longest cached prefix of ``prompt``; None when
        no node's events show its first block."""
        hashes = [external_hash(h, self._wire) for h in self._hash(prompt)]
        best = self.index.best((str(i) for i in range(len(self._subs))), hashes)
        return None if best is None else int(best[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, sub in enumerate(self._subs):
                try:
                    for got in sub.receive(timeout_s=0.01):
                        self.index.apply(str(i), got.batch)
                except KVEventsError as exc:
                    log.warning("prefill node %d sent an unreadable KV event batch: %s", i, exc)

    def close(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._thread.join(timeout=5.0)
        for sub in self._subs:
            sub.close()

    def __enter__(self) -> EventPlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

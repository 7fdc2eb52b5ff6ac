"""``OffloadEventRelay``: the offload daemon's KV events, re-announced on vLLM's own stream.

Inside vLLM the GPU cache's events come from vLLM itself (``--kv-events-config``), and the
blocks kvbridge offloads live in the daemon, which publishes them (``kvbridge offload serve
--kv-events``). With ``offload_kv_events`` set, the scheduler-side connector subscribes to
the daemon and hands its events to vLLM through ``take_events()``, so they go out on the
vLLM pod's own publisher (its endpoint, topic and replay) with medium ``CPU``, the way vLLM's
OffloadingConnector announces its tiers. The daemon's ``AllBlocksCleared`` (it restarted)
becomes a ``BlockRemoved`` of every hash relayed so far: relayed as is, it would tell
consumers that the pod's GPU cache was cleared too.

No vLLM import here: the connector converts the events to vLLM's classes.
"""

from __future__ import annotations

import logging

from kvbridge.connector.events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    ExternalHash,
    KVEventsError,
)

__all__ = ["OffloadEventRelay"]

log = logging.getLogger(__name__)

_MAX_BATCHES_PER_STEP = 256


class OffloadEventRelay:
    """Owned by the scheduler-side connector; :meth:`take` runs on vLLM's scheduler thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None) -> None:
        from_seq = 0 if replay_endpoint is not None else None
        self._sub = EventSubscriber(endpoint, replay_endpoint=replay_endpoint, from_seq=from_seq)
        self._held: dict[ExternalHash, None] = {}  # relayed as stored, in order

    def take(self) -> list[BlockStored | BlockRemoved]:
        """Events that arrived since the last call (never waits)."""
        out: list[BlockStored | BlockRemoved] = []
        for _ in range(_MAX_BATCHES_PER_STEP):
            try:
                got = list(self._sub.receive(timeout_s=0))
            except KVEventsError as exc:
                log.warning("unreadable KV events from the offload daemon: %s", exc)
                continue
            if not got:
                break
            for received in got:
                for event in received.batch.events:
                    out.extend(self._relay(event))
        return out

    def _relay(self, event: object) -> list[BlockStored | BlockRemoved]:
        if isinstance(event, BlockStored):
            self._held.update(dict.fromkeys(event.block_hashes))
            return [event]
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._held.pop(h, None)
            return [event]
        if isinstance(event, AllBlocksCleared) and self._held:
            gone = tuple(self._held)
            self._held.clear()
            return [BlockRemoved(gone, MEDIUM_CPU)]
        return []

    def close(self) -> None:
        self._sub.close()

"""``EventSubscriber``: reads one publisher's KV event stream and fills gaps by replay.

A SUB socket receives ``[topic, sequence, batch]``; when a sequence skips ahead (the
subscriber joined late or the PUB socket dropped messages at its high-water mark) and the
publisher has a replay endpoint, the subscriber asks for the missing batches over a
DEALER socket and hands them out in order before the one that revealed the gap.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.events.publisher import END_SEQ, import_zmq
from kvbridge.connector.events.wire import (
    MAX_BATCH_BYTES,
    EventBatch,
    KVEventsError,
    decode_batch,
)

__all__ = ["EventSubscriber", "ReceivedBatch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    topic: str
    seq: int
    batch: EventBatch
    replayed: bool = False


class EventSubscriber:
    """Subscribes to ``endpoint`` (connects) for ``topic`` (a prefix; ``""`` is all)."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        from_seq: int | None = None,
        hwm: int = 1000,
        context: Any = None,
    ) -> None:
        """``from_seq``: the first sequence wanted (0: everything the publisher still
        buffers, fetched by replay on the first :meth:`receive`); None: start live.
        ``hwm``: messages the SUB socket queues before it drops (ZMQ's receive HWM)."""
        zmq = import_zmq()
        self._zmq = zmq
        self._own_context = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)  # a bigger frame drops the peer
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self.next_seq: int | None = from_seq
        self._catch_up = from_seq is not None and replay_endpoint is not None
        """The sequence expected next (None until the first message)."""
        self.missed = 0
        """Batches skipped that replay could not bring back."""

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[ReceivedBatch]:
        """The publisher's buffered batches from ``start_seq`` on (needs a replay endpoint)."""
        if self._replay_endpoint is None:
            raise KVEventsError("this subscriber has no replay endpoint")
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            out: list[ReceivedBatch] = []
            while True:
                if not sock.poll(int(timeout_s * 1000)):
                    raise KVEventsError(f"no replay answer from {self._replay_endpoint}")
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise KVEventsError(f"malformed replay answer ({len(frames)} frames)")
                _, topic, seq, payload = frames
                if seq == END_SEQ:
                    return out
                out.append(ReceivedBatch(topic.decode(), _seq(seq), decode_batch(payload), True))
        finally:
            sock.close(linger=0)

    def receive(self, timeout_s: float) -> Iterator[ReceivedBatch]:
        """Batches that arrive within ``timeout_s`` (at most one message read), in order,
        with any replayed gap before the message that revealed it."""
        if self._catch_up and self.next_seq is not None:
            self._catch_up = False
            for got in self._fill(self.next_seq, None):
                self.next_seq = got.seq + 1
                yield got
        if not self._sub.poll(int(timeout_s * 1000)):
            return
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("ignoring a malformed KV events message (%d frames)", len(frames))
            return
        topic, seq_bytes, payload = frames
        seq = _seq(seq_bytes)
        if self.next_seq is not None and seq > self.next_seq:
            yield from self._fill(self.next_seq, seq)
        if self.next_seq is None or seq >= self.next_seq:
            self.next_seq = seq + 1
            yield ReceivedBatch(topic.decode(), seq, decode_batch(payload))

    def _fill(self, first: int, upto: int | None) -> Iterator[ReceivedBatch]:
        """Replayed batches ``first..upto-1`` (None: all the publisher buffers); counts
        what it could not bring back in :attr:`missed`."""
        got: list[ReceivedBatch] = []
        if self._replay_endpoint is not None:
            try:
                got = [b for b in self.replay(first) if upto is None or b.seq < upto]
            except KVEventsError as exc:
                log.warning("KV events replay failed: %s", exc)
        if got:  # the publisher no longer buffers what came before its oldest batch
            self.missed += got[0].seq - first
        if upto is not None:
            self.missed += upto - (got[-1].seq + 1 if got else first)
        yield from got

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seq(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)

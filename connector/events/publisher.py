"""``ZmqEventPublisher``: KV event batches on a ZMQ PUB socket, with replay over ROUTER.

The same wire as vLLM's ``ZmqEventPublisher``: each message is the multipart
``[topic, sequence (8 bytes, big-endian), msgpack batch]``; sequences count from 0. A
replay request on the ROUTER socket is one frame, the 8-byte start sequence (behind the
REQ/DEALER empty delimiter); the answer is one ``[topic, sequence, batch]`` message per
buffered batch from that sequence on, then ``[b"", -1 (8 bytes, signed), b""]``.

:meth:`ZmqEventPublisher.publish` never blocks its caller (block pools call it under
their owner's lock): events go on a bounded queue; one thread drains it, packs everything
queued into one batch, sends it and answers replay requests. ``pyzmq`` is imported here
only, when a publisher is made.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvbridge.connector.events.config import KVEventsConfig
from kvbridge.connector.events.wire import EventBatch, KVEvent, KVEventsError, encode_batch
from kvbridge.proto.errors import ConfigError

__all__ = ["END_SEQ", "ZmqEventPublisher", "import_zmq"]

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame that ends a replay answer."""
_MAX_EVENTS_PER_BATCH = 1024
_POLL_S = 0.05


def import_zmq() -> Any:
    """``zmq``, or a ConfigError saying how to get it."""
    try:
        import zmq
    except ImportError:
        raise ConfigError(
            "KV events need pyzmq: pip install 'kvbridge[events]' (or pyzmq>=25)"
        ) from None
    return zmq


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Owns a PUB socket, an optional ROUTER replay socket and the thread that drives both.

    Made by the process that publishes (a serving node, the offload daemon, a vLLM
    scheduler); any thread may call :meth:`publish`; :meth:`close` flushes what is queued.
    """

    def __init__(self, config: KVEventsConfig, *, context: Any = None) -> None:
        zmq = import_zmq()
        self.config = config
        self._zmq = zmq
        self._own_context = context is None
        self._ctx = zmq.Context() if context is None else context
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self.dropped = 0
        """Events refused because the queue was full."""
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self.endpoint = self._attach(self._pub, config.endpoint)
            """The PUB endpoint, with the port the OS chose for ``:0``."""
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"cannot open KV events socket: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info(
            "publishing KV events on %s (replay %s, topic %r, wire %s)",
            self.endpoint,
            self.replay_endpoint,
            config.topic,
            config.wire,
        )

    def _attach(self, sock: Any, endpoint: str) -> str:
        if _binds(endpoint):
            sock.bind(endpoint)
            return str(sock.getsockopt_string(self._zmq.LAST_ENDPOINT))
        sock.connect(endpoint)
        return endpoint

    @property
    def published(self) -> int:
        """Batches sent so far (the next batch's sequence number)."""
        return self._seq

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue events in order; never blocks (a full queue drops them and counts them)."""
        for event in events:
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 10_000 == 0:
                    log.warning("KV events queue full: %d events dropped so far", self.dropped)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued event was sent (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._queue.unfinished_tasks:
            raise KVEventsError(f"KV events still queued after {timeout_s} s")

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            log.warning("KV events thread did not stop in 10 s")
            return
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- the thread

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                first = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            events: list[KVEvent] = []
            item: KVEvent | None = first
            while True:
                if item is None:
                    stopping = True
                else:
                    events.append(item)
                self._queue.task_done()
                if stopping or len(events) >= _MAX_EVENTS_PER_BATCH:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if events:
                self._send(events)
        if self._replay is not None:
            while self._replay.poll(0):
                self._serve_replay()

    def _send(self, events: list[KVEvent]) -> None:
        batch = EventBatch(time.time(), tuple(events), self.config.data_parallel_rank)
        try:
            payload = encode_batch(batch, self.config.wire)
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload))
        except Exception:  # a publisher must never take its process down
            log.exception("could not publish %d KV events", len(events))
            return
        self._buffer.append((self._seq, payload))
        self._seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

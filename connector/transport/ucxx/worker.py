"""One process's UCX worker for the UCXX transport: the lock, the event-fd wait, tagged sends.

:class:`UcxxWorker` is made and closed by
:class:`~kvbridge.connector.transport.ucxx.transport.UcxxTransport`, and shared with its
transfer handles (:mod:`kvbridge.connector.transport.ucxx.handle`, on callers' threads)
and its service (:mod:`kvbridge.connector.transport.ucxx.service`, on the service thread).
It owns the UCX context and worker, the endpoints to peers (:class:`Peer`),
the control sends still in flight (the *outbox*) and the process's one
counter of ids (memory, link and transfer ids are never reused). Every UCX
call is made under :attr:`UcxxWorker.lock`; the methods here expect it held,
except :meth:`UcxxWorker.idle_wait`, which takes it itself.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import select
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.transport.ucxx import wire
from kvbridge.proto.errors import PeerError

__all__ = ["Peer", "UcxxWorker", "all_done", "view"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Peer:
    """The two endpoints to one peer: ``ctl`` (peer-error handling, liveness) and ``data``."""

    name: str
    address: bytes
    ctl: Any
    data: Any


def view(addr: int, nbytes: int) -> Any:
    """A writable buffer over ``nbytes`` at ``addr`` (memory kept alive by its registration)."""
    return (ctypes.c_uint8 * nbytes).from_address(addr)


def all_done(requests: Sequence[Any], start: int) -> int:
    """Index of the first unfinished request at or after ``start`` (``len`` when all are)."""
    i = start
    while i < len(requests) and requests[i].completed:
        i += 1
    return i


class UcxxWorker:
    """The UCX context, worker and peer endpoints of one transport; see the module docstring.

    ``lib`` and ``array_type`` are what :func:`~kvbridge.connector.transport.ucxx.config.load_ucxx`
    returns. :meth:`close` (the transport's, under the lock) ends it.
    """

    def __init__(self, lib: Any, array_type: Any) -> None:
        self._lib, self._array_type = lib, array_type
        self.lock = threading.RLock()
        self._context: Any = lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
        self.worker: Any = lib.UCXWorker(self._context)
        self.worker.init_blocking_progress_mode()
        self._efd: int = self.worker.epoll_file_descriptor
        self._kind_mask = lib.UCXXTagMask(wire.KIND_MASK)
        self.address = bytes(self.worker.address)
        self.peers: dict[str, Peer] = {}
        self._outbox: list[tuple[Any, Any]] = []
        self._ids: Iterator[int] = itertools.count(1)

    def next_id(self) -> int:
        """A fresh id, never reused by this process (memory, link and transfer ids share it)."""
        return next(self._ids)

    def array(self, buffer: Any) -> Any:
        return self._array_type(buffer)

    def tag(self, value: int) -> Any:
        return self._lib.UCXXTag(value)

    def progress(self) -> None:
        if self.worker is not None:
            self.worker.progress()

    def idle_wait(self, timeout_s: float) -> None:
        """Sleep until a UCX event or ``timeout_s``; returns at once when events are pending."""
        with self.lock:
            if self.worker is None:
                return
            armed = self.worker.arm()
        if armed and timeout_s > 0:
            select.select([self._efd], [], [], timeout_s)

    def probe(self, kind: int) -> Any:
        """Probe (and take) the next unexpected message whose tag is of ``kind``."""
        return self.worker.tag_probe(self.tag(kind), self._kind_mask, True)

    def receive_probed(self, buffer: bytearray, probe: Any) -> Any:
        """Receive the message ``probe`` took into ``buffer``; returns the request."""
        return self.worker.tag_recv_with_handle(self.array(buffer), probe)

    # ----- endpoints and control sends ------------------------------------------------------
    def open_peer(self, name: str, address: bytes) -> Peer:
        try:
            addr = self._lib.UCXAddress.create_from_buffer(address)
            ctl = self.worker.create_endpoint_from_worker_address(addr, True)
            data = self.worker.create_endpoint_from_worker_address(addr, False)
        except Exception as exc:
            raise PeerError(f"could not reach UCXX peer {name!r}: {exc!r}") from exc
        peer = Peer(name, address, ctl, data)
        self.peers[name] = peer
        return peer

    def send(self, peer: Peer, payload: bytes, tag: int) -> None:
        """Tag-send ``payload`` on ``peer``'s control endpoint; the outbox keeps it until done."""
        arr = self.array(payload)
        self._outbox.append((peer.ctl.tag_send(arr, self.tag(tag)), arr))

    def send_ctrl(self, peer: Peer, body: dict[str, Any]) -> None:
        self.send(peer, wire.encode(body), wire.CTRL)

    def reply(self, peer: Peer, xfer: int, step: int, body: dict[str, Any]) -> None:
        self.send(peer, wire.encode_reply(body), wire.reply_tag(xfer, step))

    def reap_outbox(self) -> None:
        keep = []
        for req, arr in self._outbox:
            if not req.completed:
                keep.append((req, arr))
                continue
            try:
                req.check_error()
            except Exception as exc:
                log.debug("a control send or endpoint close ended with %r", exc)
        self._outbox = keep

    def close(self, grace_s: float) -> int:
        """Wait up to ``grace_s`` for the outbox, then drop the worker; returns what was left."""
        end = time.monotonic() + grace_s
        while self._outbox and time.monotonic() < end:
            self.progress()
            self.reap_outbox()
            time.sleep(1e-3)
        abandoned = len(self._outbox)
        self._outbox = []
        self.worker = None
        self._context = None
        return abandoned

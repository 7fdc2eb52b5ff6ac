"""A posted UCXX READ/WRITE: :class:`UcxxTransferHandle`, the initiator's side of a transfer.

Made by :meth:`~kvbridge.connector.transport.ucxx.transport.UcxxTransport.read_blocks` /
``write_blocks`` and owned by the thread that called them, which drives the
transfer itself while it polls or waits (no other thread steps it). The
handle's state machine, under the :class:`~kvbridge.connector.transport.ucxx.worker.UcxxWorker`'s
lock:

- ``_start`` pre-posts receives for the replies (step 0; a WRITE also step 1)
  and, for a READ, one tagged receive per run into local memory; then sends
  the request to the target's service thread.
- ``_step`` takes each reply as it arrives: a refusal at step 0 fails the
  handle and leaves the link up (nothing is in flight); a WRITE's ``go`` at
  step 0 posts the sends of its runs under the target's tag. The handle is
  done when every data request and every reply it needs completed.
- ``_fail`` (a deadline, a dead peer, a bad reply, :meth:`release`) marks it
  failed, by default takes the peer down with it, and drops its requests
  (dropping a pending UCXX receive cancels it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.connector.transport.base import DeadlineHandle, LinkDownError, PeerLink, TransferState
from kvbridge.connector.transport.ucxx import wire
from kvbridge.connector.transport.ucxx.worker import Peer, UcxxWorker, all_done, view
from kvbridge.proto.errors import TransferError, TransferTimeoutError
from kvbridge.proto.layout import KVGroup

__all__ = ["LinkState", "UcxxTransferHandle"]

log = logging.getLogger(__name__)

REPLY_BYTES = 64 * 1024


@dataclass(slots=True)
class LinkState:
    """One link of the transport: its descriptor tables, pending handles, and why it is down."""

    link: PeerLink
    tables: dict[KVGroup, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]
    handles: set[UcxxTransferHandle] = field(default_factory=set)
    down: str | None = None


class UcxxTransferHandle(DeadlineHandle):
    """One posted READ/WRITE with kvbridge's own deadline; see :class:`TransferHandle`.

    Owned by the thread that called read/write_blocks; it drives progress
    itself while waiting. ``_replies`` maps a reply step to its receive.
    ``drop_peer(name, reason)`` is the transport's: it takes every link to
    the peer down when this transfer fails.
    """

    def __init__(
        self,
        ucx: UcxxWorker,
        state: LinkState,
        op: str,
        deadline: float,
        nbytes: int,
        num_descriptors: int,
        what: str,
        *,
        max_message_bytes: int,
        drop_peer: Callable[[str, str], None],
    ) -> None:
        super().__init__(deadline, nbytes, num_descriptors, what)
        self._ucx = ucx
        self._link = state
        self._op = op
        self._max_message_bytes = max_message_bytes
        self._drop_peer = drop_peer
        self._peer: Peer | None = None
        self._plan: wire.Plan | None = None
        self._data: list[Any] = []
        self._buffers: list[Any] = []
        self._replies: dict[int, tuple[bytearray, Any]] = {}
        self._acks = 0
        self._done_upto = 0

    @property
    def num_messages(self) -> int:
        """Tagged data messages this transfer uses (after merging adjacent runs)."""
        return len(self._plan) if self._plan is not None else 0

    def poll(self) -> TransferState:
        if self._state != "pending":
            return self._state
        ucx = self._ucx
        with ucx.lock:
            if self._state != "pending":
                return self._state
            ucx.progress()
            if time.monotonic() > self._deadline:
                self._fail(TransferTimeoutError(f"{self._what} did not finish before its deadline"))
            elif self._peer is None or not self._peer.ctl.alive:
                self._fail(LinkDownError(f"{self._what} failed: peer disconnected"))
            else:
                self._step()
        return self._state

    def _idle(self, rounds: int) -> None:
        self._ucx.idle_wait(min(1e-3, max(0.0, self._deadline - time.monotonic())))

    def release(self) -> None:
        with self._ucx.lock:
            if self._state == "pending":
                self._fail(LinkDownError(f"{self._what} was released before it finished"))

    # ----- internals (called under the worker's lock) --------------------------------------
    def _start(self, peer: Peer, xfer: int, plan: wire.Plan, request: dict[str, Any]) -> None:
        ucx = self._ucx
        self._peer, self._plan = peer, plan
        for step in (0, 1) if self._op == "WRITE" else (0,):
            buf = bytearray(REPLY_BYTES)
            req = peer.ctl.tag_recv(ucx.array(buf), ucx.tag(wire.reply_tag(xfer, step)))
            self._replies[step] = (buf, req)
        if self._op == "READ":
            for i, (addr, size) in enumerate(
                zip(plan.local_addrs.tolist(), plan.sizes.tolist(), strict=True)
            ):
                arr = ucx.array(view(addr, size))
                self._buffers.append(arr)
                self._data.append(peer.ctl.tag_recv(arr, ucx.tag(wire.data_tag(xfer, i))))
        ucx.send_ctrl(peer, request)

    def _step(self) -> None:
        assert self._peer is not None and self._plan is not None
        for step, (buf, req) in list(self._replies.items()):
            if not req.completed:
                continue
            del self._replies[step]
            try:
                req.check_error()
                body = wire.decode_reply(buf, self._max_message_bytes)
            except Exception as exc:
                self._fail(TransferError(f"{self._what} got no valid reply: {exc!r}"))
                return
            if body.get("ok") is not True:
                reason = body.get("error", "no reason given")
                # refused at step 0: nothing is in flight, the link stays up
                self._fail(
                    TransferError(f"{self._what} was refused by the target: {reason}"),
                    drop_link=step != 0,
                )
                return
            self._acks += 1
            if step == 0 and self._op == "WRITE":
                try:
                    base = wire.take_int(body, "tag", 1, wire.MAX_XFER - 1)
                    self._post_sends(base)
                except Exception as exc:
                    self._fail(TransferError(f"{self._what} could not send its data: {exc!r}"))
                    return
        self._done_upto = all_done(self._data, self._done_upto)
        need = 2 if self._op == "WRITE" else 1
        if self._acks < need or self._done_upto < len(self._data):
            return
        for req in self._data:
            try:
                req.check_error()
            except Exception as exc:
                self._fail(TransferError(f"{self._what} failed: {exc!r}"))
                return
        self._state = "done"
        self._release_requests()

    def _post_sends(self, base: int) -> None:
        assert self._peer is not None and self._plan is not None
        ucx = self._ucx
        for i, (addr, size) in enumerate(
            zip(self._plan.local_addrs.tolist(), self._plan.sizes.tolist(), strict=True)
        ):
            arr = ucx.array(view(addr, size))
            self._buffers.append(arr)
            self._data.append(self._peer.data.tag_send(arr, ucx.tag(wire.data_tag(base, i))))

    def _fail(self, error: TransferError, *, drop_link: bool = True) -> None:
        if self._state != "pending":
            return
        self._state = "failed"
        self._error = error
        log.warning("%s", error)
        if drop_link:
            self._drop_peer(self._link.link.peer_name, str(error))
        self._release_requests()

    def _release_requests(self) -> None:
        # dropping a pending UCXX receive cancels it; sends end when the endpoint closes
        self._data, self._buffers, self._replies = [], [], {}
        self._link.handles.discard(self)

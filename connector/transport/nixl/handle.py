"""A posted NIXL READ/WRITE (:class:`NixlTransferHandle`) and the link state it belongs to.

Made by :meth:`~kvbridge.connector.transport.nixl.transport.NixlTransport.read_blocks`
/ ``write_blocks`` and owned by the thread that called them; it polls its
own request through the :class:`~kvbridge.connector.transport.nixl.agent.NixlAgent`,
under the agent's lock. A failure (an error status, its deadline,
:meth:`~NixlTransferHandle.release` before the end) by default takes every
link to the peer down through the transport's ``drop_peer``; every path
frees the NIXL request exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.connector.transport.base import DeadlineHandle, LinkDownError, PeerLink, TransferState
from kvbridge.proto.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    from kvbridge.connector.transport.nixl.agent import NixlAgent

__all__ = ["LinkState", "NixlTransferHandle"]

log = logging.getLogger(__name__)

SPIN_POLLS = 64
"""Polls :meth:`NixlTransferHandle.wait` makes back to back before it starts sleeping
(each a NIXL status check, a few µs: together well under a millisecond)."""


@dataclass(slots=True)
class LinkState:
    """One link of the transport: its prepped lists, pending handles, and why it is down."""

    link: PeerLink
    strided: bool
    dlists: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    handles: set[NixlTransferHandle] = field(default_factory=set)
    down: str | None = None


class NixlTransferHandle(DeadlineHandle):
    """A posted NIXL request with kvbridge's own deadline; see :class:`TransferHandle`.

    ``drop_peer(name, reason)`` is the transport's: it takes every link to
    the peer down when this transfer fails.
    """

    def __init__(
        self,
        agent: NixlAgent,
        state: LinkState,
        xfer: Any,
        deadline: float,
        nbytes: int,
        num_descriptors: int,
        what: str,
        *,
        drop_peer: Callable[[str, str], None],
    ) -> None:
        super().__init__(deadline, nbytes, num_descriptors, what)
        self._agent = agent
        self._link = state
        self._xfer = xfer
        self._drop_peer = drop_peer

    def poll(self) -> TransferState:
        with self._agent.lock:
            if self._state != "pending":
                return self._state
            # the state first: a transfer that finished counts as done however late it is
            # polled (a flush READ left in flight is polled only at the next load); the
            # deadline fails only one still in flight
            status = self._agent.check(self._xfer)
            if status == "DONE":
                self._finish()
            elif status != "PROC":
                self._fail(TransferError(f"{self._what} failed: {status}"))
            elif time.monotonic() > self._deadline:
                self._fail(TransferTimeoutError(f"{self._what} did not finish before its deadline"))
            return self._state

    def _idle(self, rounds: int) -> None:
        # The first polls spin without sleeping: a READ that UCX does not finish inside the
        # post (small ones) is done within tens of µs, and a sleep hands the GIL away. In a
        # busy engine process (vLLM's step loop on the same core) taking it back can cost
        # the interpreter's whole switch interval (5 ms), measured as 10x slower short
        # loads. Then 20 µs, doubling to at most 1 ms between polls.
        if rounds < SPIN_POLLS:
            return
        time.sleep(min(2e-5 * 2 ** min(rounds - SPIN_POLLS, 6), 1e-3))

    def release(self) -> None:
        with self._agent.lock:
            if self._state == "pending":
                self._fail(LinkDownError(f"{self._what} was released before it finished"))

    def _finish(self) -> None:
        with self._agent.lock:
            self._state = "done"
            if (figures := self._agent.telemetry(self._xfer)) is not None:
                self._backend_s, self._wire_desc, self._backend_post_s = figures
            self._release_request()

    def _fail(self, error: TransferError, *, drop_link: bool = True) -> None:
        with self._agent.lock:
            if self._state != "pending":
                return
            self._state = "failed"
            self._error = error
            log.warning("%s", error)
            if drop_link:
                # unload the peer before releasing: closing its endpoint cancels what is in flight
                self._drop_peer(self._link.link.peer_name, str(error))
            self._release_request()

    def _release_request(self) -> None:
        with self._agent.lock:
            self._agent.release_xfer(self._xfer)
            self._xfer = None
            self._link.handles.discard(self)

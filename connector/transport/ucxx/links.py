"""The links of one UCXX transport and the peers behind them: connect, hello, failure.

:class:`UcxxLinks` is made and used by
:class:`~kvbridge.connector.transport.ucxx.transport.UcxxTransport` (one per
process), on its callers' threads; the transport's handles and its service
thread reach :meth:`UcxxLinks.peer_failed` through the transport when a peer
fails. Table changes are made under the
:class:`~kvbridge.connector.transport.ucxx.worker.UcxxWorker`'s lock.

``connect()`` checks the remote layout, builds both sides' descriptor tables
per group, opens the endpoints and says ``hello`` (the peer's service thread
must answer). A failed peer takes every link to it down: pending handles
fail, the service forgets the peer and its endpoints close.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvbridge.connector.transport.base import LinkDownError, LocalMemory, PeerLink
from kvbridge.connector.transport.checks import check_remote_regions, link_mode, live_state
from kvbridge.connector.transport.nixl_descs import descriptor_table, descriptors_per_block
from kvbridge.connector.transport.ucxx import wire
from kvbridge.connector.transport.ucxx.config import UcxxConfig
from kvbridge.connector.transport.ucxx.handle import REPLY_BYTES, LinkState
from kvbridge.connector.transport.ucxx.service import UcxxService
from kvbridge.connector.transport.ucxx.worker import UcxxWorker
from kvbridge.proto.errors import LayoutError, PeerError, WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode

if TYPE_CHECKING:
    from kvbridge.proto.layout import KVLayout

__all__ = ["UcxxLinks"]

log = logging.getLogger(__name__)


class UcxxLinks:
    """The transport's link table (``states``, by link id) and its peers' endpoints."""

    def __init__(self, ucx: UcxxWorker, config: UcxxConfig, service: UcxxService) -> None:
        self._ucx = ucx
        self._config = config
        self._service = service
        self.states: dict[int, LinkState] = {}

    def connect(
        self,
        peer_name: str,
        peer_metadata: bytes,
        remote_layout: KVLayout,
        local: LocalMemory,
    ) -> PeerLink:
        """A new link from registered ``local`` to the peer's memory; see the module doc."""
        try:
            info = wire.UcxxAgentInfo.from_bytes(peer_metadata)
        except WireError as exc:
            raise PeerError(
                f"metadata of {peer_name!r} is not UCXX agent metadata ({exc}); "
                "do both sides run the UCXX transport?"
            ) from exc
        if info.name != peer_name:
            raise PeerError(f"metadata is of agent {info.name!r}, expected {peer_name!r}")
        mode = link_mode(local.layout, remote_layout)
        if any(r.device != "cpu" for r in remote_layout.regions):
            raise LayoutError("the UCXX transport here is host-only; the remote memory is not")
        check_remote_regions(remote_layout)
        per_span = mode is TransferMode.PER_SPAN
        t0 = time.perf_counter()
        tables = {
            g.name: (
                descriptor_table(local.layout, g.name, per_span),
                descriptor_table(remote_layout, g.name, per_span),
            )
            for g in local.layout.groups
        }
        self._ensure_peer(info)
        prep_s = time.perf_counter() - t0
        link = PeerLink(
            link_id=self._ucx.next_id(),
            peer_name=peer_name,
            local=local,
            remote_layout=remote_layout,
            mode=mode,
            descriptors_per_block=descriptors_per_block(local.layout, KVGroup.SELF, per_span),
            prep_s=prep_s,
        )
        with self._ucx.lock:
            self.states[link.link_id] = LinkState(link, tables)
        log.info(
            "linked to %s over UCXX: %s, %d descriptor(s) per block, ready in %.1f ms",
            peer_name,
            link.mode.value,
            link.descriptors_per_block,
            prep_s * 1e3,
        )
        return link

    def disconnect(self, link: PeerLink) -> None:
        # the endpoints stay open for the next connect; close() or a failure closes them
        with self._ucx.lock:
            state = self.states.pop(link.link_id, None)
            if state is not None:
                self._drop_link(state, "disconnected")

    def live(self, link: PeerLink) -> LinkState:
        """The state of ``link``; LinkDownError if it was disconnected or is down."""
        return live_state(link, self.states.get(link.link_id))

    def peer_failed(self, name: str, reason: str) -> None:
        """Forget ``name``: links down, handles failed, serving stopped, endpoints closed."""
        for state in self.states.values():
            if state.link.peer_name == name and state.down is None:
                self._drop_link(state, reason)
        self._service.forget(name)
        # dropping the last reference closes the endpoints (UCXX's close() of an endpoint
        # that already failed returns no request to wait on)
        self._ucx.peers.pop(name, None)

    def close(self) -> None:
        """Drop every link and forget every peer (under the worker's lock)."""
        for link_id in list(self.states):
            self._drop_link(self.states.pop(link_id), "transport closed")
        for name in list(self._ucx.peers):
            self.peer_failed(name, "transport closed")

    # ----- internals (under the lock unless they take it) ---------------------------------
    def _drop_link(self, state: LinkState, reason: str) -> None:
        state.down = reason
        for handle in list(state.handles):
            handle._fail(LinkDownError(f"{handle._what}: link down ({reason})"), drop_link=False)
        state.handles.clear()
        state.tables = {}

    def _ensure_peer(self, info: wire.UcxxAgentInfo) -> None:
        """Open endpoints to ``info`` unless open and alive; say hello and wait for the reply."""
        with self._ucx.lock:
            known = self._ucx.peers.get(info.name)
            if known is not None and known.address == info.address and known.ctl.alive:
                return
            if known is not None:
                self.peer_failed(info.name, "peer reconnected with new metadata")
            peer = self._ucx.open_peer(info.name, info.address)
            xfer = self._ucx.next_id()
            buf = bytearray(REPLY_BYTES)
            req = peer.ctl.tag_recv(self._ucx.array(buf), self._ucx.tag(wire.reply_tag(xfer, 0)))
            self._ucx.send_ctrl(
                peer,
                {
                    "t": "hello",
                    "from": self._config.name,
                    "address": self._ucx.address,
                    "xfer": xfer,
                },
            )
        deadline = time.monotonic() + self._config.connect_timeout_s
        while True:
            with self._ucx.lock:
                self._ucx.progress()
                if req.completed:
                    break
                alive = peer.ctl.alive
            if not alive or time.monotonic() > deadline:
                with self._ucx.lock:
                    self.peer_failed(info.name, "no answer to hello")
                raise PeerError(
                    f"UCXX peer {info.name!r} did not answer hello within "
                    f"{self._config.connect_timeout_s:.0f} s (alive={alive}); is it running?"
                )
            self._ucx.idle_wait(1e-3)
        try:
            req.check_error()
            body = wire.decode_reply(buf, self._config.max_message_bytes)
        except Exception as exc:
            with self._ucx.lock:
                self.peer_failed(info.name, "bad answer to hello")
            raise PeerError(f"UCXX peer {info.name!r} answered hello badly: {exc!r}") from exc
        if body.get("ok") is not True:
            with self._ucx.lock:
                self.peer_failed(info.name, "hello refused")
            raise PeerError(f"UCXX peer {info.name!r} refused hello: {body.get('error')}")

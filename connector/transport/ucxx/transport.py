"""The UCXX implementation of the :class:`~kvbridge.connector.transport.Transport` seam.

Host memory over UCX's tagged send/receive, through UCXX's synchronous API
(``ucxx._lib.libucxx``; not its asyncio API, not its progress thread).
Install with ``pip install 'kvbridge[ucxx]'``; nothing else in kvbridge
needs it, and importing this module loads neither ucxx nor torch.

**Who runs what.** One transport per process (engine worker, offload daemon,
benchmark peer), made, used and closed by that process's own code. Tagged
messages are two-sided, so the process that *owns* memory moves its blocks
itself: a small **service thread** per transport answers peers' requests,
posting the sends (a peer READs) or receives (a peer WRITEs) on its memory.
Every UCX call is made under one lock. Neither the service thread nor a
waiting caller spins: with nothing to do they arm the UCX worker and sleep
in ``select`` on its event fd (woken by UCX events, at most ``idle_wait_s``).

**Modules.** This one holds registrations, links, posting, notifications
and the lifecycle; :mod:`~kvbridge.connector.transport.ucxx.config` the config and the
lazy ucxx import; :mod:`~kvbridge.connector.transport.ucxx.worker` the UCX
worker, its lock and the endpoints; :mod:`~kvbridge.connector.transport.ucxx.handle` the
initiator's side of a transfer; :mod:`~kvbridge.connector.transport.ucxx.service` the
target's side (the service thread); :mod:`~kvbridge.connector.transport.ucxx.wire` the tags,
messages and checks.

**Two endpoints per peer.** ``ctl`` has UCX peer-error handling and carries
control messages and replies; UCX allows only network transports on it, and
it is the liveness signal (a killed peer closes it at once). ``data`` has
none, so on one host bulk data goes over CMA/shared memory; elsewhere over
TCP or RDMA as UCX picks.

**Protocol** (control messages are kvbridge msgpack envelopes with tag
``CTRL``; replies carry tag ``REPLY|xfer|step`` and a 4-byte length):

- ``metadata()`` is ``{name, UCX worker address}``. ``connect()`` opens the
  endpoints and sends ``hello {from, address, xfer}``; the peer opens
  endpoints back and replies, which proves its service thread answers.
- READ: the reader plans *runs* (descriptor rows from
  :func:`~kvbridge.connector.transport.nixl_descs.descriptor_table`, neighbours adjacent
  on both sides merged), pre-posts one tagged receive per run into its own
  memory (tag ``DATA|xfer|i``, ``xfer`` its own never-reused transfer id),
  then sends ``read {from, xfer, mem, group, per_span, rows, sizes, notify,
  timeout_s}``. The target checks every row and size against its own table
  and regions, tag-sends each run from its memory and replies ok (or the
  reason it refused). Done when every run and the reply arrived.
- WRITE: the writer sends ``write`` with the same fields; the target checks,
  pre-posts receives into its memory (tags from *its* transfer ids, since
  many writers share its worker), replies ``go {tag}``; the writer sends the
  runs; the target replies ``done`` when all arrived (or its deadline passed).
- ``notify`` bytes reach the owner's :meth:`poll_notifications`, under the
  initiator's name, once the owner's side of the transfer completed;
  :meth:`send_notification` sends a ``notify`` message.
- A peer message that fails a check is answered with an error reply when it
  names a transfer, else logged and dropped; it never touches memory and
  never stops the service thread. Unexpected data or reply messages (a late
  message of a timed-out transfer) are drained into scratch buffers.

**Failure model** (as :mod:`kvbridge.connector.transport.nixl`): a failed or
timed-out transfer marks every link to that peer down, fails its pending
handles, cancels their receives and closes the endpoints; calls on a down
link raise :class:`~kvbridge.connector.transport.base.LinkDownError` until
:meth:`connect` is called again. A request the target *refused* leaves the
link up: nothing of it is in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.transport.base import (
    LinkDownError,
    LocalMemory,
    PeerLink,
    Transport,
    check_transfer_request,
)
from kvbridge.connector.transport.nixl_descs import (
    descriptor_indices,
    descriptor_table,
    descriptors_per_block,
)
from kvbridge.connector.transport.ucxx import wire
from kvbridge.connector.transport.ucxx.config import (
    UcxxConfig,
    UcxxStats,
    check_host_memory,
    load_ucxx,
)
from kvbridge.connector.transport.ucxx.handle import REPLY_BYTES, LinkState, UcxxTransferHandle
from kvbridge.connector.transport.ucxx.service import MAX_NOTIFY, Registration, UcxxService
from kvbridge.connector.transport.ucxx.worker import UcxxWorker
from kvbridge.proto.errors import (
    IncompatibleLayoutError,
    LayoutError,
    PeerError,
    TransferError,
    WireError,
)
from kvbridge.proto.negotiate import TransferMode, negotiate

if TYPE_CHECKING:
    import torch

    from kvbridge.proto.layout import KVLayout

__all__ = [
    "UcxxConfig",
    "UcxxStats",
    "UcxxTransport",
    "UcxxTransferHandle",
    "check_host_memory",
    "load_ucxx",
]

log = logging.getLogger(__name__)


class UcxxTransport(Transport):
    """This process's UCXX transport (owns a UcxxWorker and a UcxxService); see the module doc."""

    def __init__(self, config: UcxxConfig) -> None:
        self._config = config
        self._ucx = UcxxWorker(*load_ucxx())
        self._registrations: dict[int, Registration] = {}
        self._registered_addrs: dict[tuple[int, int], int] = {}
        self._links: dict[int, LinkState] = {}
        self._abandoned = 0
        self._closed = False
        self._service = UcxxService(
            self._ucx, config, find_memory=self._registration_at, drop_peer=self._peer_failed
        )
        self._service.start()

    @property
    def name(self) -> str:
        return self._config.name

    # ----- memory --------------------------------------------------------------------------
    def register(self, layout: KVLayout, kv_caches: Mapping[str, torch.Tensor]) -> LocalMemory:
        self._check_open()
        check_host_memory(kv_caches)
        bound = layout.bind(kv_caches)
        rows: list[tuple[int, int]] = []
        for region in bound.regions:
            key = (region.addr, region.length)
            if key in self._registered_addrs:
                raise LayoutError(
                    f"memory at 0x{region.addr:x} ({region.length} bytes) is already registered; "
                    "reuse that LocalMemory instead of registering it twice"
                )
            if key not in rows:
                rows.append(key)
        memory = LocalMemory(self._ucx.next_id(), bound, bound.regions[0].device)
        with self._ucx.lock:
            for key in rows:
                self._registered_addrs[key] = memory.memory_id
            self._registrations[memory.memory_id] = Registration(memory, dict(kv_caches))
        log.info(
            "registered %d region(s), %d bytes, %s layout (UCXX, host)",
            len(rows),
            sum(r[1] for r in rows),
            bound.kind,
        )
        return memory

    def unregister(self, memory: LocalMemory) -> None:
        for state in self._links.values():
            if state.link.local.memory_id == memory.memory_id and state.down is None:
                raise LayoutError(
                    f"memory {memory.memory_id} is still used by link {state.link.link_id} "
                    f"to {state.link.peer_name!r}; disconnect it first"
                )
        with self._ucx.lock:
            # a peer's transfer being served keeps the tensors alive until it ends or times out
            if self._registrations.pop(memory.memory_id, None) is None:
                return
            self._registered_addrs = {
                k: v for k, v in self._registered_addrs.items() if v != memory.memory_id
            }

    def registered_regions(self, memory: LocalMemory) -> int:
        """How many regions ``memory`` registered (aliased layers are not counted)."""
        return sum(1 for v in self._registered_addrs.values() if v == memory.memory_id)

    def metadata(self) -> bytes:
        self._check_open()
        return wire.UcxxAgentInfo(self.name, self._ucx.address).to_bytes()

    # ----- links ---------------------------------------------------------------------------
    def connect(
        self,
        peer_name: str,
        peer_metadata: bytes,
        remote_layout: KVLayout,
        local: LocalMemory,
    ) -> PeerLink:
        self._check_open()
        if local.memory_id not in self._registrations:
            raise LayoutError(f"local memory {local.memory_id} is not registered here")
        try:
            info = wire.UcxxAgentInfo.from_bytes(peer_metadata)
        except WireError as exc:
            raise PeerError(
                f"metadata of {peer_name!r} is not UCXX agent metadata ({exc}); "
                "do both sides run the UCXX transport?"
            ) from exc
        if info.name != peer_name:
            raise PeerError(f"metadata is of agent {info.name!r}, expected {peer_name!r}")
        negotiation = negotiate(local.layout, remote_layout)
        if negotiation.mode in (TransferMode.INCOMPATIBLE, TransferMode.REARRANGE):
            raise IncompatibleLayoutError(
                f"{negotiation.mode.value}: {negotiation.reason}"
                + (
                    "; stage through a buffer in the remote's order and convert locally"
                    if negotiation.mode is TransferMode.REARRANGE
                    else ""
                )
            )
        if any(r.device != "cpu" for r in remote_layout.regions):
            raise LayoutError("the UCXX transport here is host-only; the remote memory is not")
        for i, region in enumerate(remote_layout.regions):
            if region.length != remote_layout.region_bytes(i):
                raise LayoutError(
                    f"remote region {i} is {region.length} bytes, its layout says "
                    f"{remote_layout.region_bytes(i)}"
                )
        per_span = negotiation.mode is TransferMode.PER_SPAN
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
            mode=negotiation.mode,
            descriptors_per_block=descriptors_per_block(local.layout, "self", per_span),
            prep_s=prep_s,
        )
        with self._ucx.lock:
            self._links[link.link_id] = LinkState(link, tables)
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
            state = self._links.pop(link.link_id, None)
            if state is not None:
                self._drop_link(state, "disconnected")

    # ----- transfers -----------------------------------------------------------------------
    def read_blocks(
        self,
        link: PeerLink,
        group: str,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        *,
        notify: bytes | None = None,
        timeout_s: float,
    ) -> UcxxTransferHandle:
        return self._post("READ", link, group, local_ids, remote_ids, notify, timeout_s)

    def write_blocks(
        self,
        link: PeerLink,
        group: str,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        *,
        notify: bytes | None = None,
        timeout_s: float,
    ) -> UcxxTransferHandle:
        return self._post("WRITE", link, group, local_ids, remote_ids, notify, timeout_s)

    def _post(
        self,
        op: str,
        link: PeerLink,
        group: str,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        notify: bytes | None,
        timeout_s: float,
    ) -> UcxxTransferHandle:
        state = self._live_link(link)
        check_transfer_request(link, group, local_ids, remote_ids, notify, timeout_s)
        if notify is not None and len(notify) > MAX_NOTIFY:
            raise TransferError(f"notify has {len(notify)} bytes; at most {MAX_NOTIFY}")
        deadline = time.monotonic() + timeout_s
        per_span = link.mode is TransferMode.PER_SPAN
        per = descriptors_per_block(link.local.layout, group, per_span)
        what = f"{op} of {len(local_ids)} block(s) of {group!r} with {link.peer_name!r}"
        nbytes = len(local_ids) * link.local.layout.block_bytes(group)
        handle = UcxxTransferHandle(
            self._ucx,
            state,
            op,
            deadline,
            nbytes,
            len(local_ids) * per,
            what,
            max_message_bytes=self._config.max_message_bytes,
            drop_peer=self._peer_failed,
        )
        if not local_ids:
            if notify is not None:
                self.send_notification(link, notify)
            handle._state = "done"
            return handle
        local_table, remote_table = state.tables[group]
        plan = wire.plan_runs(
            local_table,
            remote_table,
            descriptor_indices(local_ids, per),
            descriptor_indices(remote_ids, per),
            self._config.coalesce,
        )
        if len(plan) > wire.MAX_MESSAGES:
            raise TransferError(f"{what} needs {len(plan)} messages; at most {wire.MAX_MESSAGES}")
        first = link.remote_layout.regions[0]
        with self._ucx.lock:
            xfer = self._ucx.next_id()
            request = {
                "t": op.lower(),
                "from": self.name,
                "xfer": xfer,
                "mem": [first.addr, first.length],
                "group": group,
                "per_span": per_span,
                **plan.wire(),
                "notify": notify,
                "timeout_s": float(timeout_s),
            }
            state.handles.add(handle)
            peer = self._ucx.peers.get(link.peer_name)
            if peer is None or not peer.ctl.alive:
                handle._fail(LinkDownError(f"{what} could not be posted: peer disconnected"))
                return handle
            try:
                handle._start(peer, xfer, plan, request)
            except Exception as exc:
                handle._fail(TransferError(f"{what} could not be posted: {exc!r}"))
        return handle

    # ----- notifications -------------------------------------------------------------------
    def send_notification(self, link: PeerLink, message: bytes) -> None:
        self._live_link(link)
        if not isinstance(message, bytes) or len(message) > MAX_NOTIFY:
            raise TransferError(f"a notification is bytes of at most {MAX_NOTIFY} bytes")
        with self._ucx.lock:
            peer = self._ucx.peers.get(link.peer_name)
            if peer is None or not peer.ctl.alive:
                raise PeerError(f"notification to {link.peer_name!r} failed: peer disconnected")
            try:
                self._ucx.send_ctrl(peer, {"t": "notify", "from": self.name, "msg": message})
            except Exception as exc:
                raise PeerError(f"notification to {link.peer_name!r} failed: {exc!r}") from exc

    def poll_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        with self._ucx.lock:
            self._ucx.progress()
            self._service.serve_once()
            return self._service.take_notifications()

    # ----- introspection and lifecycle -----------------------------------------------------
    def stats(self) -> UcxxStats:
        """A snapshot of links, handles, peers and served requests (thread-safe)."""
        with self._ucx.lock:
            live = [s for s in self._links.values()]
            return UcxxStats(
                pending=sum(len(s.handles) for s in live),
                links=len(live),
                links_down=sum(1 for s in live if s.down is not None),
                tables=sum(len(s.tables) for s in live),
                peers=tuple(sorted(self._ucx.peers)),
                served=self._service.serving,
                rejected=self._service.rejected,
                strays=self._service.strays,
                abandoned=self._abandoned,
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._service.stop()
        with self._ucx.lock:
            for link_id in list(self._links):
                self._drop_link(self._links.pop(link_id), "transport closed")
            for name in list(self._ucx.peers):
                self._peer_failed(name, "transport closed")
            self._service.clear()
            self._abandoned = self._ucx.close(grace_s=2.0)
            self._registrations.clear()
            self._registered_addrs.clear()
        if self._abandoned:
            log.warning("%d UCX request(s) unfinished at close", self._abandoned)
        log.info("UCXX transport %s closed", self.name)

    def __enter__(self) -> UcxxTransport:
        return self

    # ----- internals (under the lock unless they take it) ---------------------------------
    def _ensure_peer(self, info: wire.UcxxAgentInfo) -> None:
        """Open endpoints to ``info`` unless open and alive; say hello and wait for the reply."""
        with self._ucx.lock:
            known = self._ucx.peers.get(info.name)
            if known is not None and known.address == info.address and known.ctl.alive:
                return
            if known is not None:
                self._peer_failed(info.name, "peer reconnected with new metadata")
            peer = self._ucx.open_peer(info.name, info.address)
            xfer = self._ucx.next_id()
            buf = bytearray(REPLY_BYTES)
            req = peer.ctl.tag_recv(self._ucx.array(buf), self._ucx.tag(wire.reply_tag(xfer, 0)))
            self._ucx.send_ctrl(
                peer, {"t": "hello", "from": self.name, "address": self._ucx.address, "xfer": xfer}
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
                    self._peer_failed(info.name, "no answer to hello")
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
                self._peer_failed(info.name, "bad answer to hello")
            raise PeerError(f"UCXX peer {info.name!r} answered hello badly: {exc!r}") from exc
        if body.get("ok") is not True:
            with self._ucx.lock:
                self._peer_failed(info.name, "hello refused")
            raise PeerError(f"UCXX peer {info.name!r} refused hello: {body.get('error')}")

    def _registration_at(self, addr: int, length: int) -> Registration | None:
        """The registration whose region is ``length`` bytes at ``addr`` (for the service)."""
        memory_id = self._registered_addrs.get((addr, length))
        return self._registrations.get(memory_id) if memory_id is not None else None

    def _peer_failed(self, name: str, reason: str) -> None:
        """Forget ``name``: links down, handles failed, serving stopped, endpoints closed."""
        for state in self._links.values():
            if state.link.peer_name == name and state.down is None:
                self._drop_link(state, reason)
        self._service.forget(name)
        # dropping the last reference closes the endpoints (UCXX's close() of an endpoint
        # that already failed returns no request to wait on)
        self._ucx.peers.pop(name, None)

    def _drop_link(self, state: LinkState, reason: str) -> None:
        state.down = reason
        for handle in list(state.handles):
            handle._fail(LinkDownError(f"{handle._what}: link down ({reason})"), drop_link=False)
        state.handles.clear()
        state.tables = {}

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"UCXX transport {self.name!r} is closed")

    def _live_link(self, link: PeerLink) -> LinkState:
        self._check_open()
        state = self._links.get(link.link_id)
        if state is None:
            raise LinkDownError(f"link {link.link_id} to {link.peer_name!r} was disconnected")
        if state.down is not None:
            raise LinkDownError(
                f"link {link.link_id} to {link.peer_name!r} is down ({state.down}); "
                "connect again with the peer's fresh metadata"
            )
        return state

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

**Modules.** This one holds registrations, posting, notifications and the
lifecycle; :mod:`~kvbridge.connector.transport.ucxx.links` the links, the peers and
the hello; :mod:`~kvbridge.connector.transport.ucxx.config` the config and the
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

**Protocol**: hello, READ, WRITE and notify messages are described in
:mod:`~kvbridge.connector.transport.ucxx.wire`, beside their formats.

**Failure model** (as :mod:`kvbridge.connector.transport.nixl`): a failed or
timed-out transfer marks every link to that peer down, fails its pending
handles, cancels their receives and closes the endpoints; calls on a down
link raise :class:`~kvbridge.connector.transport.base.LinkDownError` until
:meth:`connect` is called again. A request the target *refused* leaves the
link up: nothing of it is in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.transport.base import (
    LinkDownError,
    LocalMemory,
    PeerLink,
    TransferOp,
    Transport,
)
from kvbridge.connector.transport.checks import check_memory_unlinked, checked_request
from kvbridge.connector.transport.nixl_descs import descriptor_indices
from kvbridge.connector.transport.ucxx import wire
from kvbridge.connector.transport.ucxx.config import (
    UcxxConfig,
    UcxxStats,
    check_host_memory,
    load_ucxx,
)
from kvbridge.connector.transport.ucxx.handle import LinkState, UcxxTransferHandle
from kvbridge.connector.transport.ucxx.links import UcxxLinks
from kvbridge.connector.transport.ucxx.service import MAX_NOTIFY, Registration, UcxxService
from kvbridge.connector.transport.ucxx.worker import UcxxWorker
from kvbridge.proto.errors import LayoutError, PeerError, TransferError
from kvbridge.proto.layout import KVGroup

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
        self._abandoned = 0
        self._closed = False
        self._service = UcxxService(
            self._ucx, config, find_memory=self._registration_at, drop_peer=self._peer_failed
        )
        self._links = UcxxLinks(self._ucx, config, self._service)
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
        check_memory_unlinked(memory, self._links.states.values())
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
        return self._links.connect(peer_name, peer_metadata, remote_layout, local)

    def disconnect(self, link: PeerLink) -> None:
        self._links.disconnect(link)

    # ----- transfers -----------------------------------------------------------------------
    def transfer(self, op: TransferOp) -> UcxxTransferHandle:
        return self._post(
            op.kind, op.link, op.group, op.local_ids, op.remote_ids, op.notify, op.timeout_s
        )

    def _post(
        self,
        op: str,
        link: PeerLink,
        group: KVGroup,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        notify: bytes | None,
        timeout_s: float,
    ) -> UcxxTransferHandle:
        state = self._live_link(link)
        req = checked_request(op, link, group, local_ids, remote_ids, notify, timeout_s)
        if notify is not None and len(notify) > MAX_NOTIFY:
            raise TransferError(f"notify has {len(notify)} bytes; at most {MAX_NOTIFY}")
        what = req.what
        handle = UcxxTransferHandle(
            self._ucx,
            state,
            op,
            req.deadline,
            req.nbytes,
            req.num_descriptors,
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
            descriptor_indices(local_ids, req.descriptors_per_block),
            descriptor_indices(remote_ids, req.descriptors_per_block),
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
                "per_span": req.per_span,
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
            live = [s for s in self._links.states.values()]
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
            self._links.close()
            self._service.clear()
            self._abandoned = self._ucx.close(grace_s=2.0)
            self._registrations.clear()
            self._registered_addrs.clear()
        if self._abandoned:
            log.warning("%d UCX request(s) unfinished at close", self._abandoned)
        log.info("UCXX transport %s closed", self.name)

    def __enter__(self) -> UcxxTransport:
        return self

    # ----- internals ---------------------------------------------------------------------
    def _registration_at(self, addr: int, length: int) -> Registration | None:
        """The registration whose region is ``length`` bytes at ``addr`` (for the service)."""
        memory_id = self._registered_addrs.get((addr, length))
        return self._registrations.get(memory_id) if memory_id is not None else None

    def _peer_failed(self, name: str, reason: str) -> None:
        """Take every link to ``name`` down (the service's and the handles' ``drop_peer``)."""
        self._links.peer_failed(name, reason)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"UCXX transport {self.name!r} is closed")

    def _live_link(self, link: PeerLink) -> LinkState:
        self._check_open()
        return self._links.live(link)

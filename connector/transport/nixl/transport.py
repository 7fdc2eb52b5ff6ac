"""The NIXL implementation of :class:`~kvbridge.connector.transport.base.Transport`.

Made, used and closed by the one process that owns it (the serving node,
the offload daemon, the vLLM worker, benchmark peers). This module holds the
transport's tables (registrations, links) and what it does with them;
:mod:`~kvbridge.connector.transport.nixl.agent` the NIXL agent, its lock and
the progress thread; :mod:`~kvbridge.connector.transport.nixl.handle` one
posted transfer; :mod:`~kvbridge.connector.transport.nixl_descs` the
descriptor tables.

Every agent call and every read or change of the transport's tables (links,
peers, registrations, a link's handles) is made under the agent's one
re-entrant lock, so the transport may be used from several caller threads
and the progress thread; nothing iterates a table outside it. ``transfer()``
blocks until done on same-host CMA (GIL released); never call it on an
asyncio event loop thread (see :func:`kvbridge.connector.transport.base.wait_async`).

Failure model: any failed or timed-out transfer marks **every link to that
peer down**: its pending handles fail, its prepped descriptor lists are
released and the remote agent is unloaded. Calls on a down link raise
:class:`~kvbridge.connector.transport.base.LinkDownError` until :meth:`connect` is
called again with fresh metadata (which re-preps the lists).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbridge.connector.transport.base import (
    LinkDownError,
    LocalMemory,
    PeerLink,
    TransferOp,
    Transport,
)
from kvbridge.connector.transport.checks import (
    check_memory_unlinked,
    check_remote_regions,
    checked_request,
    link_mode,
    live_state,
)
from kvbridge.connector.transport.nixl.agent import NixlAgent
from kvbridge.connector.transport.nixl.config import NixlConfig
from kvbridge.connector.transport.nixl.handle import LinkState, NixlTransferHandle
from kvbridge.connector.transport.nixl_descs import (
    descriptor_table,
    descriptors_per_block,
    device_id,
    request_indices,
    slice_indices,
    slice_table,
    strided_table,
)
from kvbridge.connector.transport.steps import link_step
from kvbridge.proto.errors import LayoutError, TransferError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode, head_slices

if TYPE_CHECKING:
    import torch

    from kvbridge.proto.layout import KVLayout

__all__ = ["NixlTransport"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Registration:
    memory: LocalMemory
    reg_descs: Any
    keep_alive: Mapping[str, torch.Tensor]


class NixlTransport(Transport):
    """NIXL agent of this process; see the module docstring for threading and failure."""

    def __init__(self, config: NixlConfig) -> None:
        self._config = config
        self._nixl = NixlAgent(config)
        self._lock = self._nixl.lock  # one lock for the agent and the tables below
        self._registrations: dict[int, _Registration] = {}
        self._registered_addrs: dict[tuple[int, int], int] = {}
        self._links: dict[int, LinkState] = {}
        self._next_id = 0
        self._closed = False

    @property
    def name(self) -> str:
        return self._config.name

    # the agent's tables, as the tests' state probes read them
    @property
    def _peers(self) -> dict[str, bytes]:
        return self._nixl.peers

    @property
    def _leaked(self) -> list[Any]:
        return self._nixl.leaked

    # ----- memory --------------------------------------------------------------------------
    def register(self, layout: KVLayout, kv_caches: Mapping[str, torch.Tensor]) -> LocalMemory:
        self._check_open()
        bound = layout.bind(kv_caches)
        device = bound.regions[0].device
        rows: list[tuple[int, int, int, str]] = []
        for region in bound.regions:
            if (region.addr, region.length) not in {(r[0], r[1]) for r in rows}:
                rows.append((region.addr, region.length, device_id(region.device), ""))
        with self._lock:
            self._check_open()
            for addr, length, _, _ in rows:
                if (addr, length) in self._registered_addrs:
                    raise LayoutError(
                        f"memory at 0x{addr:x} ({length} bytes) is already registered; "
                        "reuse that LocalMemory instead of registering it twice"
                    )
            reg = self._nixl.register_memory(rows, device)
            memory = LocalMemory(self._new_id(), bound, device)
            for addr, length, _, _ in rows:
                self._registered_addrs[(addr, length)] = memory.memory_id
            self._registrations[memory.memory_id] = _Registration(memory, reg, dict(kv_caches))
        log.info(
            "registered %d region(s), %d bytes, %s layout on %s",
            len(rows),
            sum(r[1] for r in rows),
            bound.kind,
            device,
        )
        return memory

    def unregister(self, memory: LocalMemory) -> None:
        with self._lock:
            check_memory_unlinked(memory, self._links.values())
            reg = self._registrations.pop(memory.memory_id, None)
            if reg is None:
                return
            self._registered_addrs = {
                k: v for k, v in self._registered_addrs.items() if v != memory.memory_id
            }
            self._nixl.deregister_memory(reg.reg_descs)

    def registered_regions(self, memory: LocalMemory) -> int:
        """How many regions ``memory`` registered (aliased layers are not counted)."""
        with self._lock:
            return sum(1 for v in self._registered_addrs.values() if v == memory.memory_id)

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            return self._nixl.metadata()

    # ----- links ---------------------------------------------------------------------------
    def connect(
        self,
        peer_name: str,
        peer_metadata: bytes,
        remote_layout: KVLayout,
        local: LocalMemory,
    ) -> PeerLink:
        self._check_open()
        with self._lock:
            if local.memory_id not in self._registrations:
                raise LayoutError(f"local memory {local.memory_id} is not registered here")
        mode = link_mode(local.layout, remote_layout, head_slice=True)
        check_remote_regions(remote_layout)
        per_span = mode is TransferMode.PER_SPAN
        strided = self._config.strided_descriptors and mode is not TransferMode.HEAD_SLICE
        if mode is TransferMode.HEAD_SLICE:  # dense tables of page slices, paired page by page
            (lp, lk), (rp, rk) = head_slices(local.layout, remote_layout)
            local_tables = {
                g.name: slice_table(local.layout, g.name, lp, lk) for g in local.layout.groups
            }
            remote_tables = {
                g.name: slice_table(remote_layout, g.name, rp, rk) for g in remote_layout.groups
            }
        else:
            build = strided_table if strided else descriptor_table
            local_tables = {
                g.name: build(local.layout, g.name, per_span) for g in local.layout.groups
            }
            remote_tables = {
                g.name: build(remote_layout, g.name, per_span) for g in remote_layout.groups
            }
        with self._lock:
            # checked again under the lock: close() or unregister() may have run meanwhile
            self._check_open()
            if local.memory_id not in self._registrations:
                raise LayoutError(f"local memory {local.memory_id} was unregistered meanwhile")
            link_step(f"NIXL add_remote_agent (loading {peer_name}'s agent metadata)")
            self._load_peer(peer_name, peer_metadata)
            link_step(f"NIXL descriptor list prep for {peer_name}")
            t0 = time.perf_counter()
            dlists = self._nixl.prep_dlists(
                peer_name, local_tables, local.device, remote_tables, remote_layout.regions
            )
            prep_s = time.perf_counter() - t0
            link = PeerLink(
                link_id=self._new_id(),
                peer_name=peer_name,
                local=local,
                remote_layout=remote_layout,
                mode=mode,
                descriptors_per_block=(
                    len(local.layout.owning_layers(KVGroup.SELF))
                    if mode is TransferMode.HEAD_SLICE
                    else descriptors_per_block(local.layout, KVGroup.SELF, per_span)
                ),
                prep_s=prep_s,
            )
            self._links[link.link_id] = LinkState(link, strided, dlists)
        log.info(
            "linked to %s: %s, %d descriptor(s) per block, %s lists prepped in %.1f ms",
            peer_name,
            link.mode.value,
            link.descriptors_per_block,
            "strided" if strided else "dense",
            prep_s * 1e3,
        )
        return link

    def disconnect(self, link: PeerLink) -> None:
        with self._lock:
            state = self._links.pop(link.link_id, None)
            if state is None:
                return
            self._drop_link(state, "disconnected")
            if not any(s.link.peer_name == link.peer_name for s in self._links.values()):
                self._nixl.remove_peer(link.peer_name)

    # ----- transfers -----------------------------------------------------------------------
    def transfer(self, op: TransferOp) -> NixlTransferHandle:
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
    ) -> NixlTransferHandle:
        state = self._live_link(link)
        req = checked_request(op, link, group, local_ids, remote_ids, notify, timeout_s)
        what = req.what
        handle = NixlTransferHandle(
            self._nixl,
            state,
            None,
            req.deadline,
            req.nbytes,
            req.num_descriptors,
            what,
            drop_peer=self._peer_failed,
        )
        if not local_ids:
            if notify is not None:
                self.send_notification(link, notify)
            handle._state = "done"
            return handle
        if link.mode is TransferMode.HEAD_SLICE:
            local_idx, remote_idx = slice_indices(link.local.layout, group, local_ids, remote_ids)
        else:
            local_idx, remote_idx = request_indices(
                link.local.layout,
                link.remote_layout,
                group,
                local_ids,
                remote_ids,
                per_span=req.per_span,
                strided=state.strided,
            )
        with self._lock:
            # checked again under the lock: another thread may have dropped the link (and
            # released its prepped lists) since the check above
            self._live_link(link)
            local_h, remote_h = state.dlists[group]
            try:
                handle._xfer = self._nixl.make_xfer(
                    op, local_h, local_idx, remote_h, remote_idx, notify or b""
                )
                state.handles.add(handle)
                status = self._nixl.start(handle._xfer)
            except Exception as exc:
                kind = LinkDownError if "Disconnect" in type(exc).__name__ else TransferError
                handle._fail(kind(f"{what} could not be posted: {exc!r}"))
                return handle
            if status == "DONE":
                handle._finish()
            elif status != "PROC":
                handle._fail(TransferError(f"{what} failed when posted: {status}"))
        return handle

    # ----- notifications -------------------------------------------------------------------
    def send_notification(self, link: PeerLink, message: bytes) -> None:
        with self._lock:
            self._live_link(link)
            self._nixl.send_notification(link.peer_name, message)

    def poll_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        return self._nixl.take_notifications()

    # ----- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            # from here every other call raises "closed"; one already inside holds the lock
            self._closed = True
        self._nixl.stop_progress()  # not under the lock: the progress loop takes it
        with self._lock:
            for state in list(self._links.values()):
                self._drop_link(state, "transport closed")
            self._links.clear()
            for peer in list(self._nixl.peers):
                self._nixl.remove_peer(peer)
            for reg in list(self._registrations.values()):
                self.unregister(reg.memory)
            self._nixl.close()
        log.info("NIXL transport %s closed", self._config.name)

    def __enter__(self) -> NixlTransport:
        return self

    # ----- internals -----------------------------------------------------------------------
    def _new_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"NIXL transport {self._config.name!r} is closed")

    def _live_link(self, link: PeerLink) -> LinkState:
        with self._lock:
            self._check_open()
            return live_state(link, self._links.get(link.link_id))

    def _load_peer(self, peer_name: str, peer_metadata: bytes) -> None:
        with self._lock:
            known = self._nixl.peers.get(peer_name)
            if known == peer_metadata:
                return
            if known is not None:
                self._peer_failed(peer_name, "peer reconnected with new metadata")
            self._nixl.add_peer(peer_name, peer_metadata)

    def _peer_failed(self, peer_name: str, reason: str) -> None:
        """Unload ``peer_name``, then fail every link to it: handles released, lists dropped."""
        with self._lock:
            self._nixl.remove_peer(peer_name)
            for state in list(self._links.values()):
                if state.link.peer_name == peer_name and state.down is None:
                    self._drop_link(state, reason)

    def _drop_link(self, state: LinkState, reason: str) -> None:
        with self._lock:
            state.down = reason
            for handle in list(state.handles):
                handle._fail(
                    LinkDownError(f"{handle._what}: link down ({reason})"), drop_link=False
                )
                handle._release_request()
            self._nixl.release_dlists(state.dlists)
            state.dlists = {}

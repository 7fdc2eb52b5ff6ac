"""The NIXL implementation of :class:`~kvbridge.connector.transport.base.Transport`.

One NIXL agent per process, created with NIXL's progress thread **off**
(DESIGN.md §5: an idle one burns a core on 2-core machines). kvbridge drives
progress itself: a waiting transfer polls its own state, and a small
background thread of ours (``progress_interval_s``, sleeping between polls,
stopped by :meth:`NixlTransport.close`) polls notifications, which also
progresses UCX for peers that READ from us over TCP.

Every agent call and every read or change of the transport's tables (links,
peers, registrations, a link's handles) is made under one re-entrant lock, so
the transport may be used from several caller threads and the progress thread;
nothing iterates a table outside it. ``transfer()`` blocks until done on
same-host CMA (GIL released); never call it on an asyncio event loop thread
(see :func:`kvbridge.connector.transport.base.wait_async`).

Failure model: any failed or timed-out transfer marks **every link to that
peer down**: its pending handles fail, its prepped descriptor lists are
released and the remote agent is unloaded. Calls on a down link raise
:class:`~kvbridge.connector.transport.base.LinkDownError` until :meth:`connect` is
called again with fresh metadata (which re-preps the lists).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.connector.transport.base import (
    LinkDownError,
    LocalMemory,
    PeerLink,
    TransferHandle,
    TransferState,
    Transport,
    check_transfer_request,
)
from kvbridge.connector.transport.nixl_descs import (
    descriptor_table,
    descriptors_per_block,
    device_id,
    mem_type,
    request_indices,
    strided_table,
)
from kvbridge.proto.errors import (
    ConfigError,
    IncompatibleLayoutError,
    LayoutError,
    PeerError,
    TransferError,
    TransferTimeoutError,
)
from kvbridge.proto.negotiate import TransferMode, negotiate

if TYPE_CHECKING:
    import torch

    from kvbridge.proto.layout import KVLayout

__all__ = ["NixlConfig", "NixlTransport", "NixlTransferHandle", "load_nixl"]

log = logging.getLogger(__name__)


def load_nixl() -> Any:
    """Import NIXL's Python API lazily (``nixl_cu12._api``, else ``nixl._api``).

    Sets ``UCX_MODULES=^ib`` first unless the environment says otherwise:
    without it every process segfaults at exit on these machines.
    """
    os.environ.setdefault("UCX_MODULES", "^ib")
    try:
        import nixl_cu12._api as api
    except ImportError:
        try:
            import nixl._api as api  # type: ignore[no-redef]
        except ImportError as exc:
            raise ConfigError(
                "NIXL is not installed: pip install 'nixl-cu12==1.5.1' (after torch)"
            ) from exc
    return api


@dataclass(frozen=True, slots=True)
class NixlConfig:
    """Settings of one process's NIXL transport; built once at the edge.

    ``strided_descriptors`` preps NIXL's compressed Nx5 lists (one row per
    region, :func:`~kvbridge.connector.transport.nixl_descs.strided_table`) instead of
    one Nx3 row per descriptor (:func:`~kvbridge.connector.transport.nixl_descs.descriptor_table`);
    both move the same bytes with the same descriptors. See DESIGN-NOTES.md,
    "NIXL descriptor lists".
    """

    name: str
    progress_interval_s: float | None = 0.002
    backends: tuple[str, ...] = ("UCX",)
    strided_descriptors: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("NixlConfig.name must be a non-empty agent name, unique per process")
        if self.progress_interval_s is not None and not 0 < self.progress_interval_s <= 1:
            raise ConfigError(
                f"NixlConfig.progress_interval_s={self.progress_interval_s} must be in (0, 1] "
                "seconds, or None for no background progress thread"
            )
        if not self.backends:
            raise ConfigError("NixlConfig.backends must name at least one NIXL backend")
        if not isinstance(self.strided_descriptors, bool):
            raise ConfigError(
                f"NixlConfig.strided_descriptors={self.strided_descriptors!r} must be True "
                "(compressed Nx5 descriptor lists) or False (one Nx3 row per descriptor)"
            )


@dataclass(slots=True)
class _Registration:
    memory: LocalMemory
    reg_descs: Any
    keep_alive: Mapping[str, torch.Tensor]


@dataclass(slots=True)
class _LinkState:
    link: PeerLink
    strided: bool
    dlists: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    handles: set[NixlTransferHandle] = field(default_factory=set)
    down: str | None = None


class NixlTransferHandle(TransferHandle):
    """A posted NIXL request with kvbridge's own deadline; see :class:`TransferHandle`."""

    def __init__(
        self,
        transport: NixlTransport,
        state: _LinkState,
        xfer: Any,
        deadline: float,
        nbytes: int,
        num_descriptors: int,
        what: str,
    ) -> None:
        self._transport = transport
        self._link = state
        self._xfer = xfer
        self._deadline = deadline
        self._nbytes = nbytes
        self._ndesc = num_descriptors
        self._what = what
        self._state: TransferState = "pending"
        self._error: TransferError | None = None

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_descriptors(self) -> int:
        return self._ndesc

    @property
    def error(self) -> TransferError | None:
        return self._error

    def poll(self) -> TransferState:
        with self._transport._lock:
            if self._state != "pending":
                return self._state
            if time.monotonic() > self._deadline:
                self._fail(TransferTimeoutError(f"{self._what} did not finish before its deadline"))
                return self._state
            status = self._transport._check(self._xfer)
            if status == "DONE":
                self._finish()
            elif status != "PROC":
                self._fail(TransferError(f"{self._what} failed: {status}"))
            return self._state

    def wait(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None:
            self._deadline = min(self._deadline, time.monotonic() + timeout_s)
        pause = 2e-5
        while (state := self.poll()) == "pending":
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if state == "failed":
            assert self._error is not None
            raise self._error

    def release(self) -> None:
        with self._transport._lock:
            if self._state == "pending":
                self._fail(LinkDownError(f"{self._what} was released before it finished"))

    def _finish(self) -> None:
        with self._transport._lock:
            self._state = "done"
            self._release_request()

    def _fail(self, error: TransferError, *, drop_link: bool = True) -> None:
        with self._transport._lock:
            if self._state != "pending":
                return
            self._state = "failed"
            self._error = error
            log.warning("%s", error)
            if drop_link:
                # unload the peer before releasing: closing its endpoint cancels what is in flight
                self._transport._peer_failed(self._link.link.peer_name, str(error))
            self._release_request()

    def _release_request(self) -> None:
        with self._transport._lock:
            self._transport._release_xfer(self._xfer)
            self._xfer = None
            self._link.handles.discard(self)


class NixlTransport(Transport):
    """NIXL agent of this process; see the module docstring for threading and failure."""

    def __init__(self, config: NixlConfig) -> None:
        api = load_nixl()
        self._config = config
        self._lock = threading.RLock()
        self._agent: Any = api.nixl_agent(
            config.name,
            api.nixl_agent_config(enable_prog_thread=False, backends=list(config.backends)),
        )
        self._registrations: dict[int, _Registration] = {}
        self._registered_addrs: dict[tuple[int, int], int] = {}
        self._links: dict[int, _LinkState] = {}
        self._peers: dict[str, bytes] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._leaked: list[Any] = []
        self._next_id = 0
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if config.progress_interval_s is not None:
            self._thread = threading.Thread(
                target=self._progress_loop, name=f"kvbridge-nixl-{config.name}", daemon=True
            )
            self._thread.start()

    @property
    def name(self) -> str:
        return self._config.name

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
            reg = self._agent.register_memory(rows, mem_type(device))
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
            for state in self._links.values():
                if state.link.local.memory_id == memory.memory_id and state.down is None:
                    raise LayoutError(
                        f"memory {memory.memory_id} is still used by link {state.link.link_id} "
                        f"to {state.link.peer_name!r}; disconnect it first"
                    )
            reg = self._registrations.pop(memory.memory_id, None)
            if reg is None:
                return
            self._registered_addrs = {
                k: v for k, v in self._registered_addrs.items() if v != memory.memory_id
            }
            self._agent.deregister_memory(reg.reg_descs)

    def registered_regions(self, memory: LocalMemory) -> int:
        """How many regions ``memory`` registered (aliased layers are not counted)."""
        with self._lock:
            return sum(1 for v in self._registered_addrs.values() if v == memory.memory_id)

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            md: bytes = self._agent.get_agent_metadata()
        return md

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
        for i, region in enumerate(remote_layout.regions):
            if region.length != remote_layout.region_bytes(i):
                raise LayoutError(
                    f"remote region {i} is {region.length} bytes, its layout says "
                    f"{remote_layout.region_bytes(i)}"
                )
        per_span = negotiation.mode is TransferMode.PER_SPAN
        strided = self._config.strided_descriptors
        build = strided_table if strided else descriptor_table
        local_tables = {g.name: build(local.layout, g.name, per_span) for g in local.layout.groups}
        remote_tables = {
            g.name: build(remote_layout, g.name, per_span) for g in remote_layout.groups
        }
        with self._lock:
            # checked again under the lock: close() or unregister() may have run meanwhile
            self._check_open()
            if local.memory_id not in self._registrations:
                raise LayoutError(f"local memory {local.memory_id} was unregistered meanwhile")
            self._load_peer(peer_name, peer_metadata)
            t0 = time.perf_counter()
            dlists: dict[str, tuple[Any, Any]] = {}
            try:
                for group, table in local_tables.items():
                    lh = self._agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", table, mem_type(local.device)
                    )
                    dev = remote_layout.regions[0].device
                    rh = self._agent.prep_xfer_dlist(peer_name, remote_tables[group], mem_type(dev))
                    dlists[group] = (lh, rh)
            except Exception as exc:
                self._release_dlists(dlists)
                raise PeerError(
                    f"could not prepare descriptors for {peer_name!r}: {exc!r}; does its "
                    "metadata include the memory in its layout (register before exporting "
                    "metadata)?"
                ) from exc
            prep_s = time.perf_counter() - t0
            link = PeerLink(
                link_id=self._new_id(),
                peer_name=peer_name,
                local=local,
                remote_layout=remote_layout,
                mode=negotiation.mode,
                descriptors_per_block=descriptors_per_block(local.layout, "self", per_span),
                prep_s=prep_s,
            )
            self._links[link.link_id] = _LinkState(link, strided, dlists)
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
                self._unload_peer(link.peer_name)

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
    ) -> NixlTransferHandle:
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
    ) -> NixlTransferHandle:
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
    ) -> NixlTransferHandle:
        state = self._live_link(link)
        check_transfer_request(link, group, local_ids, remote_ids, notify, timeout_s)
        deadline = time.monotonic() + timeout_s
        per_span = link.mode is TransferMode.PER_SPAN
        per = descriptors_per_block(link.local.layout, group, per_span)
        what = f"{op} of {len(local_ids)} block(s) of {group!r} with {link.peer_name!r}"
        nbytes = len(local_ids) * link.local.layout.block_bytes(group)
        handle = NixlTransferHandle(self, state, None, deadline, nbytes, len(local_ids) * per, what)
        if not local_ids:
            if notify is not None:
                self.send_notification(link, notify)
            handle._state = "done"
            return handle
        local_idx, remote_idx = request_indices(
            link.local.layout,
            link.remote_layout,
            group,
            local_ids,
            remote_ids,
            per_span=per_span,
            strided=state.strided,
        )
        with self._lock:
            # checked again under the lock: another thread may have dropped the link (and
            # released its prepped lists) since the check above
            self._live_link(link)
            local_h, remote_h = state.dlists[group]
            try:
                handle._xfer = self._agent.make_prepped_xfer(
                    op, local_h, local_idx, remote_h, remote_idx, notify or b""
                )
                state.handles.add(handle)
                status = self._agent.transfer(handle._xfer)
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
            try:
                self._agent.send_notif(link.peer_name, message)
            except Exception as exc:
                raise PeerError(f"notification to {link.peer_name!r} failed: {exc!r}") from exc

    def poll_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        self._pump()
        with self._lock:
            out, self._notifs = self._notifs, {}
        return out

    # ----- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            # from here every other call raises "closed"; one already inside holds the lock
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # not under the lock: the progress loop takes it
        with self._lock:
            for state in list(self._links.values()):
                self._drop_link(state, "transport closed")
            self._links.clear()
            for peer in list(self._peers):
                self._unload_peer(peer)
            for reg in list(self._registrations.values()):
                self.unregister(reg.memory)
            for xfer in self._leaked:
                try:
                    xfer.release()
                except Exception as exc:
                    log.warning("a transfer request could not be released at close: %r", exc)
            self._leaked.clear()
            self._agent = None
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

    def _live_link(self, link: PeerLink) -> _LinkState:
        with self._lock:
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

    def _load_peer(self, peer_name: str, peer_metadata: bytes) -> None:
        with self._lock:
            known = self._peers.get(peer_name)
            if known == peer_metadata:
                return
            if known is not None:
                self._peer_failed(peer_name, "peer reconnected with new metadata")
            try:
                loaded = self._agent.add_remote_agent(peer_metadata)
            except Exception as exc:
                raise PeerError(f"could not load metadata of {peer_name!r}: {exc!r}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer_name:
                self._agent.remove_remote_agent(name)
                raise PeerError(f"metadata is of agent {name!r}, expected {peer_name!r}")
            self._peers[peer_name] = peer_metadata

    def _unload_peer(self, peer_name: str) -> None:
        with self._lock:
            if self._peers.pop(peer_name, None) is None:
                return
            try:
                self._agent.remove_remote_agent(peer_name)
            except Exception as exc:
                log.warning("removing peer %s: %r", peer_name, exc)

    def _peer_failed(self, peer_name: str, reason: str) -> None:
        """Unload ``peer_name``, then fail every link to it: handles released, lists dropped."""
        with self._lock:
            self._unload_peer(peer_name)
            for state in list(self._links.values()):
                if state.link.peer_name == peer_name and state.down is None:
                    self._drop_link(state, reason)

    def _drop_link(self, state: _LinkState, reason: str) -> None:
        with self._lock:
            state.down = reason
            for handle in list(state.handles):
                handle._fail(
                    LinkDownError(f"{handle._what}: link down ({reason})"), drop_link=False
                )
                handle._release_request()
            self._release_dlists(state.dlists)
            state.dlists = {}

    def _release_dlists(self, dlists: Mapping[str, tuple[Any, Any]]) -> None:
        with self._lock:
            for pair in dlists.values():
                for dlist in pair:
                    try:
                        dlist.release()
                    except Exception as exc:
                        log.warning("releasing a prepped descriptor list: %r", exc)

    def _release_xfer(self, xfer: Any) -> None:
        if xfer is None:
            return
        with self._lock:
            try:
                xfer.release()
            except Exception as exc:
                log.debug("transfer request not released yet (%r); retrying at close", exc)
                self._leaked.append(xfer)

    def _check(self, xfer: Any) -> str:
        try:
            with self._lock:
                status: str = self._agent.check_xfer_state(xfer)
        except Exception as exc:
            return f"error {exc!r}"
        return status

    def _pump(self) -> None:
        try:
            with self._lock:
                if self._agent is None:
                    return
                new = self._agent.get_new_notifs()
                for peer, messages in new.items():
                    self._notifs.setdefault(str(peer), []).extend(messages)
        except Exception as exc:
            log.debug("polling notifications: %r", exc)

    def _progress_loop(self) -> None:
        interval = self._config.progress_interval_s
        assert interval is not None
        while not self._stop.wait(interval):
            self._pump()

"""The UCXX implementation of :class:`~kvbridge.worker.transport.Transport` (optional extra).

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
  :func:`~kvbridge.worker.nixl_descs.descriptor_table`, neighbours adjacent
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

**Failure model** (as :mod:`kvbridge.worker.nixl_transport`): a failed or
timed-out transfer marks every link to that peer down, fails its pending
handles, cancels their receives and closes the endpoints; calls on a down
link raise :class:`~kvbridge.worker.transport.LinkDownError` until
:meth:`connect` is called again. A request the target *refused* leaves the
link up: nothing of it is in flight.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvbridge.proto import codec
from kvbridge.proto.errors import (
    ConfigError,
    IncompatibleLayoutError,
    LayoutError,
    PeerError,
    TransferError,
    TransferTimeoutError,
    WireError,
)
from kvbridge.proto.negotiate import TransferMode, negotiate
from kvbridge.worker import ucxx_wire as wire
from kvbridge.worker.nixl_descs import descriptor_indices, descriptor_table
from kvbridge.worker.transport import (
    LinkDownError,
    LocalMemory,
    PeerLink,
    TransferHandle,
    TransferState,
    Transport,
    check_transfer_ids,
)

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

_REPLY_BYTES = 64 * 1024
_MAX_NOTIFY = 64 * 1024
_MAX_ADDRESS = 1 << 16
_MAX_SCRATCH = 256 * 1024 * 1024
_PROBES_PER_ROUND = 64


def load_ucxx() -> tuple[Any, Any]:
    """Import UCXX's synchronous API lazily: ``(ucxx._lib.libucxx, ucxx._lib.arr.Array)``.

    Sets ``UCX_MODULES=^ib`` (DESIGN.md §5) and host staging for rendezvous
    unless the environment says otherwise, and drops the ``UCX_MEMTYPE_CACHE``
    knob UCXX sets at import, which this UCX no longer knows (it would warn
    at every context).
    """
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")
    memtype_preset = "UCX_MEMTYPE_CACHE" in os.environ
    try:
        import ucxx._lib.libucxx as lib
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise ConfigError(
            "UCXX is not installed: pip install 'kvbridge[ucxx]' (ucxx-cu12, which also runs "
            "without a GPU), or use the NIXL transport"
        ) from exc
    if not memtype_preset:
        os.environ.pop("UCX_MEMTYPE_CACHE", None)
    return lib, Array


def check_host_memory(kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Raise LayoutError unless every tensor is in host memory (this transport is host-only)."""
    for name, tensor in kv_caches.items():
        if tensor.device.type != "cpu":
            raise LayoutError(
                f"tensor {name!r} is on {tensor.device}; the UCXX transport here is host-only "
                "(tagged send/receive of host memory): register CPU tensors, or use the NIXL "
                "transport for device memory"
            )


@dataclass(frozen=True, slots=True)
class UcxxConfig:
    """Settings of one process's UCXX transport; built once at the edge."""

    name: str
    idle_wait_s: float = 0.005
    connect_timeout_s: float = 10.0
    max_message_bytes: int = codec.MAX_MESSAGE_BYTES
    max_serve_s: float = 600.0
    coalesce: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("UcxxConfig.name must be a non-empty agent name, unique per process")
        if not 0 < self.idle_wait_s <= 1:
            raise ConfigError(
                f"UcxxConfig.idle_wait_s={self.idle_wait_s} must be in (0, 1] seconds"
            )
        if not self.connect_timeout_s > 0:
            raise ConfigError(
                f"UcxxConfig.connect_timeout_s={self.connect_timeout_s} must be > 0 seconds"
            )
        if not 4096 <= self.max_message_bytes <= 1 << 30:
            raise ConfigError(
                f"UcxxConfig.max_message_bytes={self.max_message_bytes} must be in 4096..2**30"
            )
        if not self.max_serve_s > 0:
            raise ConfigError(f"UcxxConfig.max_serve_s={self.max_serve_s} must be > 0 seconds")


@dataclass(frozen=True, slots=True)
class UcxxStats:
    """A snapshot of one transport's state, for tests and logs (:meth:`UcxxTransport.stats`).

    ``abandoned`` counts requests and endpoint closes still unfinished when
    :meth:`UcxxTransport.close` stopped waiting for them (0 after a clean close).
    """

    pending: int
    links: int
    links_down: int
    tables: int
    peers: tuple[str, ...]
    served: int
    rejected: int
    strays: int
    abandoned: int


@dataclass(slots=True)
class _Peer:
    name: str
    address: bytes
    ctl: Any
    data: Any


@dataclass(slots=True)
class _Registration:
    memory: LocalMemory
    keep_alive: Mapping[str, torch.Tensor]
    serving: dict[tuple[str, bool], tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = field(
        default_factory=dict
    )


@dataclass(slots=True)
class _LinkState:
    link: PeerLink
    tables: dict[str, tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]
    handles: set[UcxxTransferHandle] = field(default_factory=set)
    down: str | None = None


@dataclass(slots=True)
class _Served:
    """A peer's READ or WRITE this process is serving (sends or receives on its memory)."""

    peer: str
    op: str
    xfer: int
    requests: list[Any]
    buffers: list[Any]
    notify: bytes | None
    deadline: float
    keep_alive: Mapping[str, Any]
    done_upto: int = 0


def _view(addr: int, nbytes: int) -> Any:
    """A writable buffer over ``nbytes`` at ``addr`` (memory kept alive by its registration)."""
    return (ctypes.c_uint8 * nbytes).from_address(addr)


def _all_done(requests: Sequence[Any], start: int) -> int:
    """Index of the first unfinished request at or after ``start`` (``len`` when all are)."""
    i = start
    while i < len(requests) and requests[i].completed:
        i += 1
    return i


def _per_block(layout: KVLayout, group: str, per_span: bool) -> int:
    return 2 * len(layout.owning_layers(group)) if per_span else 1


class UcxxTransferHandle(TransferHandle):
    """One posted READ/WRITE with kvbridge's own deadline; see :class:`TransferHandle`.

    Owned by the thread that called read/write_blocks; it drives progress
    itself while waiting. ``_replies`` maps a reply step to its receive.
    """

    def __init__(
        self,
        transport: UcxxTransport,
        state: _LinkState,
        op: str,
        deadline: float,
        nbytes: int,
        num_descriptors: int,
        what: str,
    ) -> None:
        self._transport = transport
        self._link = state
        self._op = op
        self._deadline = deadline
        self._nbytes = nbytes
        self._ndesc = num_descriptors
        self._what = what
        self._state: TransferState = "pending"
        self._error: TransferError | None = None
        self._peer: _Peer | None = None
        self._plan: wire.Plan | None = None
        self._data: list[Any] = []
        self._buffers: list[Any] = []
        self._replies: dict[int, tuple[bytearray, Any]] = {}
        self._acks = 0
        self._done_upto = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_descriptors(self) -> int:
        return self._ndesc

    @property
    def num_messages(self) -> int:
        """Tagged data messages this transfer uses (after merging adjacent runs)."""
        return len(self._plan) if self._plan is not None else 0

    @property
    def error(self) -> TransferError | None:
        return self._error

    def poll(self) -> TransferState:
        if self._state != "pending":
            return self._state
        t = self._transport
        with t._lock:
            if self._state != "pending":
                return self._state
            t._progress()
            if time.monotonic() > self._deadline:
                self._fail(TransferTimeoutError(f"{self._what} did not finish before its deadline"))
            elif self._peer is None or not self._peer.ctl.alive:
                self._fail(LinkDownError(f"{self._what} failed: peer disconnected"))
            else:
                self._step()
        return self._state

    def wait(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None:
            self._deadline = min(self._deadline, time.monotonic() + timeout_s)
        while (state := self.poll()) == "pending":
            self._transport._idle_wait(min(1e-3, max(0.0, self._deadline - time.monotonic())))
        if state == "failed":
            assert self._error is not None
            raise self._error

    def release(self) -> None:
        with self._transport._lock:
            if self._state == "pending":
                self._fail(LinkDownError(f"{self._what} was released before it finished"))

    # ----- internals (called under the transport's lock) ---------------------------------
    def _start(self, peer: _Peer, xfer: int, plan: wire.Plan, request: dict[str, Any]) -> None:
        t = self._transport
        self._peer, self._plan = peer, plan
        for step in (0, 1) if self._op == "WRITE" else (0,):
            buf = bytearray(_REPLY_BYTES)
            req = peer.ctl.tag_recv(t._array(buf), t._tag(wire.reply_tag(xfer, step)))
            self._replies[step] = (buf, req)
        if self._op == "READ":
            for i, (addr, size) in enumerate(
                zip(plan.local_addrs.tolist(), plan.sizes.tolist(), strict=True)
            ):
                arr = t._array(_view(addr, size))
                self._buffers.append(arr)
                self._data.append(peer.ctl.tag_recv(arr, t._tag(wire.data_tag(xfer, i))))
        t._send_ctrl(peer, request)

    def _step(self) -> None:
        assert self._peer is not None and self._plan is not None
        for step, (buf, req) in list(self._replies.items()):
            if not req.completed:
                continue
            del self._replies[step]
            try:
                req.check_error()
                body = wire.decode_reply(buf, self._transport._config.max_message_bytes)
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
        self._done_upto = _all_done(self._data, self._done_upto)
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
        t = self._transport
        for i, (addr, size) in enumerate(
            zip(self._plan.local_addrs.tolist(), self._plan.sizes.tolist(), strict=True)
        ):
            arr = t._array(_view(addr, size))
            self._buffers.append(arr)
            self._data.append(self._peer.data.tag_send(arr, t._tag(wire.data_tag(base, i))))

    def _fail(self, error: TransferError, *, drop_link: bool = True) -> None:
        if self._state != "pending":
            return
        self._state = "failed"
        self._error = error
        log.warning("%s", error)
        if drop_link:
            self._transport._peer_failed(self._link.link.peer_name, str(error))
        self._release_requests()

    def _release_requests(self) -> None:
        # dropping a pending UCXX receive cancels it; sends end when the endpoint closes
        self._data, self._buffers, self._replies = [], [], {}
        self._link.handles.discard(self)


class UcxxTransport(Transport):
    """UCXX worker of this process; see the module docstring for threads, protocol, failure."""

    def __init__(self, config: UcxxConfig) -> None:
        lib, array = load_ucxx()
        self._lib, self._array_type = lib, array
        self._config = config
        self._lock = threading.RLock()
        self._context: Any = lib.UCXContext(feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
        self._worker: Any = lib.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._efd: int = self._worker.epoll_file_descriptor
        self._address = bytes(self._worker.address)
        self._registrations: dict[int, _Registration] = {}
        self._registered_addrs: dict[tuple[int, int], int] = {}
        self._links: dict[int, _LinkState] = {}
        self._peers: dict[str, _Peer] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._served: list[_Served] = []
        self._incoming: list[tuple[bytearray, int, Any]] = []
        self._strays: list[tuple[bytearray, Any]] = []
        self._outbox: list[tuple[Any, Any]] = []
        self._ids = itertools.count(1)
        self._rejected = 0
        self._stray_count = 0
        self._abandoned = 0
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._service_loop, name=f"kvbridge-ucxx-{config.name}", daemon=True
        )
        self._thread.start()

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
        memory = LocalMemory(next(self._ids), bound, bound.regions[0].device)
        with self._lock:
            for key in rows:
                self._registered_addrs[key] = memory.memory_id
            self._registrations[memory.memory_id] = _Registration(memory, dict(kv_caches))
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
        with self._lock:
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
        return wire.UcxxAgentInfo(self.name, self._address).to_bytes()

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
            link_id=next(self._ids),
            peer_name=peer_name,
            local=local,
            remote_layout=remote_layout,
            mode=negotiation.mode,
            descriptors_per_block=_per_block(local.layout, "self", per_span),
            prep_s=prep_s,
        )
        with self._lock:
            self._links[link.link_id] = _LinkState(link, tables)
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
        with self._lock:
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
        if not timeout_s > 0:
            raise TransferError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        state = self._live_link(link)
        check_transfer_ids(link.local.layout, link.remote_layout, group, local_ids, remote_ids)
        if notify is not None and not isinstance(notify, bytes):
            raise TransferError(f"notify must be bytes, got {type(notify).__name__}")
        if notify is not None and len(notify) > _MAX_NOTIFY:
            raise TransferError(f"notify has {len(notify)} bytes; at most {_MAX_NOTIFY}")
        deadline = time.monotonic() + timeout_s
        per_span = link.mode is TransferMode.PER_SPAN
        per = _per_block(link.local.layout, group, per_span)
        what = f"{op} of {len(local_ids)} block(s) of {group!r} with {link.peer_name!r}"
        nbytes = len(local_ids) * link.local.layout.block_bytes(group)
        handle = UcxxTransferHandle(self, state, op, deadline, nbytes, len(local_ids) * per, what)
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
        with self._lock:
            xfer = next(self._ids)
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
            peer = self._peers.get(link.peer_name)
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
        if not isinstance(message, bytes) or len(message) > _MAX_NOTIFY:
            raise TransferError(f"a notification is bytes of at most {_MAX_NOTIFY} bytes")
        with self._lock:
            peer = self._peers.get(link.peer_name)
            if peer is None or not peer.ctl.alive:
                raise PeerError(f"notification to {link.peer_name!r} failed: peer disconnected")
            try:
                self._send_ctrl(peer, {"t": "notify", "from": self.name, "msg": message})
            except Exception as exc:
                raise PeerError(f"notification to {link.peer_name!r} failed: {exc!r}") from exc

    def poll_notifications(self) -> dict[str, list[bytes]]:
        self._check_open()
        with self._lock:
            self._progress()
            self._serve_once()
            out, self._notifs = self._notifs, {}
        return out

    # ----- introspection and lifecycle -----------------------------------------------------
    def stats(self) -> UcxxStats:
        """A snapshot of links, handles, peers and served requests (thread-safe)."""
        with self._lock:
            live = [s for s in self._links.values()]
            return UcxxStats(
                pending=sum(len(s.handles) for s in live),
                links=len(live),
                links_down=sum(1 for s in live if s.down is not None),
                tables=sum(len(s.tables) for s in live),
                peers=tuple(sorted(self._peers)),
                served=len(self._served),
                rejected=self._rejected,
                strays=self._stray_count,
                abandoned=self._abandoned,
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()
        with self._lock:
            for link_id in list(self._links):
                self._drop_link(self._links.pop(link_id), "transport closed")
            for name in list(self._peers):
                self._peer_failed(name, "transport closed")
            self._served, self._incoming, self._strays = [], [], []
            end = time.monotonic() + 2.0
            while self._outbox and time.monotonic() < end:
                self._progress()
                self._reap_outbox()
                time.sleep(1e-3)
            self._abandoned = len(self._outbox)
            self._outbox = []
            self._registrations.clear()
            self._registered_addrs.clear()
            self._worker = None
            self._context = None
        if self._abandoned:
            log.warning("%d UCX request(s) unfinished at close", self._abandoned)
        log.info("UCXX transport %s closed", self.name)

    def __enter__(self) -> UcxxTransport:
        return self

    # ----- internals: UCX calls (under the lock) -------------------------------------------
    def _array(self, buffer: Any) -> Any:
        return self._array_type(buffer)

    def _tag(self, value: int) -> Any:
        return self._lib.UCXXTag(value)

    def _progress(self) -> None:
        if self._worker is not None:
            self._worker.progress()

    def _idle_wait(self, timeout_s: float) -> None:
        """Sleep until a UCX event or ``timeout_s``; returns at once when events are pending."""
        with self._lock:
            if self._worker is None:
                return
            armed = self._worker.arm()
        if armed and timeout_s > 0:
            select.select([self._efd], [], [], timeout_s)

    def _send_ctrl(self, peer: _Peer, body: dict[str, Any]) -> None:
        arr = self._array(wire.encode(body))
        self._outbox.append((peer.ctl.tag_send(arr, self._tag(wire.CTRL)), arr))

    def _reply(self, peer: _Peer, xfer: int, step: int, body: dict[str, Any]) -> None:
        arr = self._array(wire.encode_reply(body))
        self._outbox.append((peer.ctl.tag_send(arr, self._tag(wire.reply_tag(xfer, step))), arr))

    def _open_peer(self, name: str, address: bytes) -> _Peer:
        try:
            addr = self._lib.UCXAddress.create_from_buffer(address)
            ctl = self._worker.create_endpoint_from_worker_address(addr, True)
            data = self._worker.create_endpoint_from_worker_address(addr, False)
        except Exception as exc:
            raise PeerError(f"could not reach UCXX peer {name!r}: {exc!r}") from exc
        peer = _Peer(name, address, ctl, data)
        self._peers[name] = peer
        return peer

    def _ensure_peer(self, info: wire.UcxxAgentInfo) -> None:
        """Open endpoints to ``info`` unless open and alive; say hello and wait for the reply."""
        with self._lock:
            known = self._peers.get(info.name)
            if known is not None and known.address == info.address and known.ctl.alive:
                return
            if known is not None:
                self._peer_failed(info.name, "peer reconnected with new metadata")
            peer = self._open_peer(info.name, info.address)
            xfer = next(self._ids)
            buf = bytearray(_REPLY_BYTES)
            req = peer.ctl.tag_recv(self._array(buf), self._tag(wire.reply_tag(xfer, 0)))
            self._send_ctrl(
                peer, {"t": "hello", "from": self.name, "address": self._address, "xfer": xfer}
            )
        deadline = time.monotonic() + self._config.connect_timeout_s
        while True:
            with self._lock:
                self._progress()
                if req.completed:
                    break
                alive = peer.ctl.alive
            if not alive or time.monotonic() > deadline:
                with self._lock:
                    self._peer_failed(info.name, "no answer to hello")
                raise PeerError(
                    f"UCXX peer {info.name!r} did not answer hello within "
                    f"{self._config.connect_timeout_s:.0f} s (alive={alive}); is it running?"
                )
            self._idle_wait(1e-3)
        try:
            req.check_error()
            body = wire.decode_reply(buf, self._config.max_message_bytes)
        except Exception as exc:
            with self._lock:
                self._peer_failed(info.name, "bad answer to hello")
            raise PeerError(f"UCXX peer {info.name!r} answered hello badly: {exc!r}") from exc
        if body.get("ok") is not True:
            with self._lock:
                self._peer_failed(info.name, "hello refused")
            raise PeerError(f"UCXX peer {info.name!r} refused hello: {body.get('error')}")

    def _peer_failed(self, name: str, reason: str) -> None:
        """Forget ``name``: links down, handles failed, serving stopped, endpoints closed."""
        for state in self._links.values():
            if state.link.peer_name == name and state.down is None:
                self._drop_link(state, reason)
        self._served = [s for s in self._served if s.peer != name]
        # dropping the last reference closes the endpoints (UCXX's close() of an endpoint
        # that already failed returns no request to wait on)
        self._peers.pop(name, None)

    def _drop_link(self, state: _LinkState, reason: str) -> None:
        state.down = reason
        for handle in list(state.handles):
            handle._fail(LinkDownError(f"{handle._what}: link down ({reason})"), drop_link=False)
        state.handles.clear()
        state.tables = {}

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"UCXX transport {self.name!r} is closed")

    def _live_link(self, link: PeerLink) -> _LinkState:
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

    # ----- internals: the service side (under the lock) ------------------------------------
    def _service_loop(self) -> None:
        """The service thread: progress, answer peers, then sleep until a UCX event."""
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._worker is None:
                        return
                    self._progress()
                    self._serve_once()
                    busy = bool(self._served or self._incoming)
                wait = min(1e-3, self._config.idle_wait_s) if busy else self._config.idle_wait_s
                self._idle_wait(wait)
            except Exception:
                log.exception("UCXX service loop of %s (continuing)", self.name)
                self._stop.wait(self._config.idle_wait_s)

    def _serve_once(self) -> None:
        self._receive_control()
        self._drain_strays()
        self._reap_outbox()
        self._reap_served()

    def _receive_control(self) -> None:
        limit = self._config.max_message_bytes
        mask = self._lib.UCXXTagMask(wire.KIND_MASK)
        for _ in range(_PROBES_PER_ROUND):
            probe = self._worker.tag_probe(self._tag(wire.CTRL), mask, True)
            if not probe.matched:
                break
            length = int(probe.length)
            # an oversized message lands truncated in one byte and is refused below
            buf = bytearray(max(1, length) if length <= limit else 1)
            req = self._worker.tag_recv_with_handle(self._array(buf), probe)
            self._incoming.append((buf, length, req))
        waiting = []
        for buf, length, req in self._incoming:
            if not req.completed:
                waiting.append((buf, length, req))
                continue
            try:
                req.check_error()
                if length > limit:
                    raise WireError(f"control message of {length} bytes exceeds {limit}")
                self._on_message(bytes(buf[:length]))
            except Exception as exc:
                self._rejected += 1
                log.warning("dropped a malformed control message (%d bytes): %s", length, exc)
        self._incoming = waiting

    def _drain_strays(self) -> None:
        """Receive data/reply messages nobody waits for (late parts of failed transfers)."""
        mask = self._lib.UCXXTagMask(wire.KIND_MASK)
        for kind in (wire.DATA, wire.REPLY):
            for _ in range(_PROBES_PER_ROUND):
                probe = self._worker.tag_probe(self._tag(kind), mask, True)
                if not probe.matched:
                    break
                length = int(probe.length)
                buf = bytearray(max(1, length) if length <= _MAX_SCRATCH else 1)
                req = self._worker.tag_recv_with_handle(self._array(buf), probe)
                self._strays.append((buf, req))
                self._stray_count += 1
                log.info("draining a stray %d-byte message", length)
        self._strays = [(b, r) for b, r in self._strays if not r.completed]

    def _reap_outbox(self) -> None:
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

    def _reap_served(self) -> None:
        now = time.monotonic()
        keep = []
        for s in self._served:
            peer = self._peers.get(s.peer)
            s.done_upto = _all_done(s.requests, s.done_upto)
            if s.done_upto == len(s.requests):
                self._finish_served(s, peer)
            elif now > s.deadline or peer is None or not peer.ctl.alive:
                log.warning("gave up serving %s %d from %s", s.op, s.xfer, s.peer)
                if s.op == "write" and peer is not None and peer.ctl.alive:
                    self._reply(peer, s.xfer, 1, {"ok": False, "error": "target deadline passed"})
            else:
                keep.append(s)
        self._served = keep

    def _finish_served(self, s: _Served, peer: _Peer | None) -> None:
        error = None
        for req in s.requests:
            try:
                req.check_error()
            except Exception as exc:
                error = repr(exc)
                break
        if error is None and s.notify is not None:
            self._notifs.setdefault(s.peer, []).append(s.notify)
        if error is not None:
            log.warning("serving %s %d from %s failed: %s", s.op, s.xfer, s.peer, error)
        if s.op == "write" and peer is not None:
            self._reply(peer, s.xfer, 1, {"ok": error is None, "error": error})

    def _on_message(self, data: bytes) -> None:
        body = wire.decode(data, self._config.max_message_bytes)
        kind = codec.take(body, "t", str)
        sender = codec.take(body, "from", str)
        if kind == "hello":
            self._on_hello(sender, body)
            return
        peer = self._peers.get(sender)
        if peer is None:
            raise WireError(f"{kind!r} from {sender!r}, which never said hello")
        if kind == "notify":
            message = wire.take_optional_bytes(body, "msg", _MAX_NOTIFY)
            if message is None:
                raise WireError("notify without msg")
            self._notifs.setdefault(sender, []).append(message)
            return
        xfer = wire.take_int(body, "xfer", 1, wire.MAX_XFER - 1)
        try:
            if kind == "read":
                self._on_read(peer, xfer, body)
            elif kind == "write":
                self._on_write(peer, xfer, body)
            else:
                raise WireError(f"unknown control message {kind!r}")
        except Exception as exc:
            self._rejected += 1
            reason = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("refused %s %d from %s: %s", kind, xfer, sender, reason)
            self._reply(peer, xfer, 0, {"ok": False, "error": reason})

    def _on_hello(self, sender: str, body: Mapping[str, Any]) -> None:
        address = wire.take_optional_bytes(body, "address", _MAX_ADDRESS)
        xfer = wire.take_int(body, "xfer", 1, wire.MAX_XFER - 1)
        if not address or not sender:
            raise WireError("hello needs a sender name and a worker address")
        peer = self._peers.get(sender)
        if peer is None or peer.address != address or not peer.ctl.alive:
            if peer is not None:
                self._peer_failed(sender, "peer said hello from a new address")
            peer = self._open_peer(sender, address)
        self._reply(peer, xfer, 0, {"ok": True, "name": self.name})

    def _serving(
        self, body: Mapping[str, Any]
    ) -> tuple[_Registration, list[tuple[int, int]], bytes | None, float]:
        """Check a peer's read/write against this process's own memory; runs to move."""
        mem = codec.take(body, "mem", list)
        if len(mem) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in mem):
            raise WireError("mem must be [address, length] of the memory's first region")
        memory_id = self._registered_addrs.get((mem[0], mem[1]))
        reg = self._registrations.get(memory_id) if memory_id is not None else None
        if reg is None:
            raise WireError(f"no memory registered here at 0x{mem[0]:x} ({mem[1]} bytes)")
        group = codec.take(body, "group", str)
        per_span = codec.take(body, "per_span", bool)
        layout = reg.memory.layout
        layout.group(group)
        key = (group, per_span)
        if key not in reg.serving:
            reg.serving[key] = (
                descriptor_table(layout, group, per_span),
                wire.region_bounds(layout, group),
            )
        table, bounds = reg.serving[key]
        runs = wire.check_runs(table, bounds, body.get("rows"), body.get("sizes"))
        notify = wire.take_optional_bytes(body, "notify", _MAX_NOTIFY)
        timeout_s = codec.take(body, "timeout_s", float)
        if not 0 < timeout_s <= self._config.max_serve_s:
            raise WireError(f"timeout_s={timeout_s} is outside (0, {self._config.max_serve_s}]")
        return reg, runs, notify, timeout_s

    def _on_read(self, peer: _Peer, xfer: int, body: Mapping[str, Any]) -> None:
        reg, runs, notify, timeout_s = self._serving(body)
        requests, buffers = [], []
        for i, (addr, size) in enumerate(runs):
            arr = self._array(_view(addr, size))
            buffers.append(arr)
            requests.append(peer.data.tag_send(arr, self._tag(wire.data_tag(xfer, i))))
        deadline = time.monotonic() + timeout_s
        self._served.append(
            _Served(peer.name, "read", xfer, requests, buffers, notify, deadline, reg.keep_alive)
        )
        self._reply(peer, xfer, 0, {"ok": True})

    def _on_write(self, peer: _Peer, xfer: int, body: Mapping[str, Any]) -> None:
        reg, runs, notify, timeout_s = self._serving(body)
        base = next(self._ids)
        requests, buffers = [], []
        for i, (addr, size) in enumerate(runs):
            arr = self._array(_view(addr, size))
            buffers.append(arr)
            requests.append(peer.ctl.tag_recv(arr, self._tag(wire.data_tag(base, i))))
        deadline = time.monotonic() + timeout_s
        self._served.append(
            _Served(peer.name, "write", xfer, requests, buffers, notify, deadline, reg.keep_alive)
        )
        self._reply(peer, xfer, 0, {"ok": True, "tag": base})

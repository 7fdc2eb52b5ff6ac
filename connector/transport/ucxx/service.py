"""The target side of the UCXX transport: :class:`UcxxService` answers peers' requests.

Tagged messages are two-sided, so the process that owns memory moves its
blocks itself. The service receives control messages (tag ``CTRL``) from
peers, checks each ``read``/``write`` against this process's own registered
memory, and posts the sends (a peer READs) or receives (a peer WRITEs) on
that memory; a :class:`Served` tracks each until it completes or its
deadline passes. It also answers ``hello``, collects ``notify`` messages and
drains stray data/reply messages (late parts of failed transfers) into
scratch buffers. A message that fails a check is answered with an error
reply when it names a transfer, else logged and dropped; it never touches
memory and never stops the service thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvbridge.connector.transport.base import LocalMemory
from kvbridge.connector.transport.nixl_descs import descriptor_table
from kvbridge.connector.transport.ucxx import wire
from kvbridge.connector.transport.ucxx.worker import Peer, UcxxWorker, all_done, view
from kvbridge.proto import codec
from kvbridge.proto.errors import WireError
from kvbridge.proto.layout import parse_group

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.ucxx.config import UcxxConfig

__all__ = ["MAX_NOTIFY", "Registration", "Served", "UcxxService"]

log = logging.getLogger(__name__)

MAX_NOTIFY = 64 * 1024
_MAX_ADDRESS = 1 << 16
_MAX_SCRATCH = 256 * 1024 * 1024
_PROBES_PER_ROUND = 64


@dataclass(slots=True)
class Registration:
    """Memory this process registered, with the descriptor tables peers' requests are checked by."""

    memory: LocalMemory
    keep_alive: Mapping[str, torch.Tensor]
    serving: dict[tuple[str, bool], tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]] = field(
        default_factory=dict
    )


@dataclass(slots=True)
class Served:
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


class UcxxService:
    """Serves peers' requests on one transport's memory; owned by that transport.

    Runs on the **service thread** it starts (:meth:`start`, joined by
    :meth:`stop`), which progresses the worker, calls :meth:`serve_once`,
    then sleeps on the worker's event fd; the transport also calls
    :meth:`serve_once` from :meth:`poll_notifications`. Everything but
    :meth:`start`/:meth:`stop` runs under the worker's lock. It owns the
    control messages being received, the strays being drained, the
    transfers being served and the notifications received and not yet taken.
    The transport supplies ``find_memory(addr, length)`` (the registration
    whose first region that is) and ``drop_peer(name, reason)``.
    """

    def __init__(
        self,
        ucx: UcxxWorker,
        config: UcxxConfig,
        *,
        find_memory: Callable[[int, int], Registration | None],
        drop_peer: Callable[[str, str], None],
    ) -> None:
        self._ucx = ucx
        self._config = config
        self._find_memory = find_memory
        self._drop_peer = drop_peer
        self._served: list[Served] = []
        self._incoming: list[tuple[bytearray, int, Any]] = []
        self._strays: list[tuple[bytearray, Any]] = []
        self._notifs: dict[str, list[bytes]] = {}
        self.rejected = 0
        self.strays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"kvbridge-ucxx-{config.name}", daemon=True
        )

    @property
    def serving(self) -> int:
        """How many peers' transfers are being served."""
        return len(self._served)

    # ----- lifecycle (the transport's thread) ----------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the service thread and wait for it; call before closing the worker."""
        self._stop.set()
        self._thread.join()

    # ----- called by the transport under the lock ------------------------------------------
    def serve_once(self) -> None:
        self._receive_control()
        self._drain_strays()
        self._ucx.reap_outbox()
        self._reap_served()

    def take_notifications(self) -> dict[str, list[bytes]]:
        out, self._notifs = self._notifs, {}
        return out

    def forget(self, peer: str) -> None:
        """Stop serving ``peer`` (its requests are dropped with its endpoints)."""
        self._served = [s for s in self._served if s.peer != peer]

    def clear(self) -> None:
        self._served, self._incoming, self._strays = [], [], []

    # ----- the service thread --------------------------------------------------------------
    def _loop(self) -> None:
        """The service thread: progress, answer peers, then sleep until a UCX event."""
        ucx, config = self._ucx, self._config
        while not self._stop.is_set():
            try:
                with ucx.lock:
                    if ucx.worker is None:
                        return
                    ucx.progress()
                    self.serve_once()
                    busy = bool(self._served or self._incoming)
                wait = min(1e-3, config.idle_wait_s) if busy else config.idle_wait_s
                ucx.idle_wait(wait)
            except Exception:
                log.exception("UCXX service loop of %s (continuing)", config.name)
                self._stop.wait(config.idle_wait_s)

    # ----- internals (under the lock) ------------------------------------------------------
    def _receive_control(self) -> None:
        limit = self._config.max_message_bytes
        for _ in range(_PROBES_PER_ROUND):
            probe = self._ucx.probe(wire.CTRL)
            if not probe.matched:
                break
            length = int(probe.length)
            # an oversized message lands truncated in one byte and is refused below
            buf = bytearray(max(1, length) if length <= limit else 1)
            req = self._ucx.receive_probed(buf, probe)
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
                self.rejected += 1
                log.warning("dropped a malformed control message (%d bytes): %s", length, exc)
        self._incoming = waiting

    def _drain_strays(self) -> None:
        """Receive data/reply messages nobody waits for (late parts of failed transfers)."""
        for kind in (wire.DATA, wire.REPLY):
            for _ in range(_PROBES_PER_ROUND):
                probe = self._ucx.probe(kind)
                if not probe.matched:
                    break
                length = int(probe.length)
                buf = bytearray(max(1, length) if length <= _MAX_SCRATCH else 1)
                req = self._ucx.receive_probed(buf, probe)
                self._strays.append((buf, req))
                self.strays += 1
                log.info("draining a stray %d-byte message", length)
        self._strays = [(b, r) for b, r in self._strays if not r.completed]

    def _reap_served(self) -> None:
        now = time.monotonic()
        keep = []
        for s in self._served:
            peer = self._ucx.peers.get(s.peer)
            s.done_upto = all_done(s.requests, s.done_upto)
            if s.done_upto == len(s.requests):
                self._finish_served(s, peer)
            elif now > s.deadline or peer is None or not peer.ctl.alive:
                log.warning("gave up serving %s %d from %s", s.op, s.xfer, s.peer)
                if s.op == "write" and peer is not None and peer.ctl.alive:
                    self._ucx.reply(
                        peer, s.xfer, 1, {"ok": False, "error": "target deadline passed"}
                    )
            else:
                keep.append(s)
        self._served = keep

    def _finish_served(self, s: Served, peer: Peer | None) -> None:
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
            self._ucx.reply(peer, s.xfer, 1, {"ok": error is None, "error": error})

    def _on_message(self, data: bytes) -> None:
        body = wire.decode(data, self._config.max_message_bytes)
        kind = codec.take(body, "t", str)
        sender = codec.take(body, "from", str)
        if kind == "hello":
            self._on_hello(sender, body)
            return
        peer = self._ucx.peers.get(sender)
        if peer is None:
            raise WireError(f"{kind!r} from {sender!r}, which never said hello")
        if kind == "notify":
            message = wire.take_optional_bytes(body, "msg", MAX_NOTIFY)
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
            self.rejected += 1
            reason = f"{type(exc).__name__}: {exc}"[:2000]
            log.warning("refused %s %d from %s: %s", kind, xfer, sender, reason)
            self._ucx.reply(peer, xfer, 0, {"ok": False, "error": reason})

    def _on_hello(self, sender: str, body: Mapping[str, Any]) -> None:
        address = wire.take_optional_bytes(body, "address", _MAX_ADDRESS)
        xfer = wire.take_int(body, "xfer", 1, wire.MAX_XFER - 1)
        if not address or not sender:
            raise WireError("hello needs a sender name and a worker address")
        peer = self._ucx.peers.get(sender)
        if peer is None or peer.address != address or not peer.ctl.alive:
            if peer is not None:
                self._drop_peer(sender, "peer said hello from a new address")
            peer = self._ucx.open_peer(sender, address)
        self._ucx.reply(peer, xfer, 0, {"ok": True, "name": self._config.name})

    def _check_request(
        self, body: Mapping[str, Any]
    ) -> tuple[Registration, list[tuple[int, int]], bytes | None, float]:
        """Check a peer's read/write against this process's own memory; runs to move."""
        mem = codec.take(body, "mem", list)
        if len(mem) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in mem):
            raise WireError("mem must be [address, length] of the memory's first region")
        reg = self._find_memory(mem[0], mem[1])
        if reg is None:
            raise WireError(f"no memory registered here at 0x{mem[0]:x} ({mem[1]} bytes)")
        group = parse_group(codec.take(body, "group", str), WireError)
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
        notify = wire.take_optional_bytes(body, "notify", MAX_NOTIFY)
        timeout_s = codec.take(body, "timeout_s", float)
        if not 0 < timeout_s <= self._config.max_serve_s:
            raise WireError(f"timeout_s={timeout_s} is outside (0, {self._config.max_serve_s}]")
        return reg, runs, notify, timeout_s

    def _on_read(self, peer: Peer, xfer: int, body: Mapping[str, Any]) -> None:
        self._serve(peer, "read", xfer, xfer, body)
        self._ucx.reply(peer, xfer, 0, {"ok": True})

    def _on_write(self, peer: Peer, xfer: int, body: Mapping[str, Any]) -> None:
        base = self._ucx.next_id()  # our own ids: many writers share this worker
        self._serve(peer, "write", xfer, base, body)
        self._ucx.reply(peer, xfer, 0, {"ok": True, "tag": base})

    def _serve(self, peer: Peer, kind: str, xfer: int, base: int, body: Mapping[str, Any]) -> None:
        """Check a peer's request, then post one tagged send (``read``: the peer reads our
        memory) or receive (``write``) per run, tags ``DATA|base|i``; track it as served."""
        reg, runs, notify, timeout_s = self._check_request(body)
        requests, buffers = [], []
        for i, (addr, size) in enumerate(runs):
            arr = self._ucx.array(view(addr, size))
            buffers.append(arr)
            tag = self._ucx.tag(wire.data_tag(base, i))
            requests.append(
                peer.data.tag_send(arr, tag) if kind == "read" else peer.ctl.tag_recv(arr, tag)
            )
        deadline = time.monotonic() + timeout_s
        self._served.append(
            Served(peer.name, kind, xfer, requests, buffers, notify, deadline, reg.keep_alive)
        )

"""The NIXL agent of one process behind one lock, and the thread that progresses it.

Owned by :class:`~kvbridge.connector.transport.nixl.transport.NixlTransport`
(one per process) and used by its handles. Every NIXL call kvbridge makes
goes through :class:`NixlAgent`, under :attr:`NixlAgent.lock`; the lock is
re-entrant because the transport holds it across several calls while it
changes its own tables.

The agent is created with NIXL's own progress thread **sleeping in poll()**
until UCX has work (:mod:`~kvbridge.connector.transport.nixl.progress`; NIXL's
Python API would make it spin a core): it answers peers whose READs wait on this
process (a flush after a notification, over TCP) as their messages arrive. A
waiting transfer polls its own state. Without the native thread
(``NixlConfig.native_progress=False``, or a NIXL without the knob) a small
background thread of ours (``progress_interval_s``, sleeping between polls, stopped
by :meth:`NixlAgent.stop_progress`) polls notifications, which also progresses UCX
for peers.

Before the agent is made, :func:`reserve_fd_table` grows the process's file
descriptor table to :data:`FD_TABLE_SLOTS`: Linux grows it on the first open
past its size and, in a process of several threads, waits for an RCU grace
period there, which took 13-25 s on the loaded 2-core machine. UCX opens files
while NIXL loads a peer's metadata (``add_remote_agent``), so a vLLM rank with a
full table paid that wait inside its first link (see DESIGN-NOTES.md, "Link set-up
under load"). The table never shrinks: grown once at start, no link waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvbridge.connector.transport.nixl.config import NixlConfig, load_nixl
from kvbridge.connector.transport.nixl.progress import new_agent
from kvbridge.connector.transport.nixl_descs import mem_type
from kvbridge.proto.errors import PeerError
from kvbridge.proto.layout import KVGroup

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from kvbridge.proto.layout import Region

__all__ = ["FD_TABLE_SLOTS", "NixlAgent", "fd_table_size", "reserve_fd_table"]

log = logging.getLogger(__name__)

FD_TABLE_SLOTS = 4096
"""File descriptor table slots reserved before the agent is made (capped by the soft
``RLIMIT_NOFILE``): 32 KiB of kernel memory."""

CLOSE_PROGRESS_ROUNDS = 4
"""Progress rounds at close, so that requests cancelled by a dead peer complete first."""


def fd_table_size() -> int | None:
    """This process's file descriptor table size (``FDSize`` in ``/proc/self/status``);
    None where there is no such file."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("FDSize:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reserve_fd_table(slots: int = FD_TABLE_SLOTS) -> int | None:
    """Grow the file descriptor table to ``slots`` now (one descriptor at ``slots - 1``,
    opened and closed), so that no later open waits for the kernel to grow it; capped
    below the soft ``RLIMIT_NOFILE``. Returns the table size after, if known."""
    try:
        import fcntl
        import resource
    except ImportError:  # not Linux/Unix: nothing to reserve
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = slots if soft == resource.RLIM_INFINITY else min(slots, soft)
    size = fd_table_size()
    if size is not None and size >= top:
        return size
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # the lowest free descriptor at or above ``top - 1``: never one in use
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top - 1)
        os.close(high)
    except OSError as exc:
        log.debug("could not reserve %d descriptor slots: %r", top, exc)
    finally:
        os.close(fd)
    return fd_table_size()


class NixlAgent:
    """One NIXL agent: its remote agents, unreleased requests, notifications and progress.

    ``peers`` maps each loaded remote agent's name to the metadata it was
    loaded from; ``leaked`` holds requests NIXL would not release yet (retried
    at :meth:`close`). Both are read and changed only under ``lock``.
    """

    def __init__(self, config: NixlConfig) -> None:
        api = load_nixl()
        reserve_fd_table()
        self._config = config
        self.lock = threading.RLock()
        self._agent: Any
        self._agent, self.native_progress = new_agent(api, config)
        """Whether NIXL's own (event-driven) progress thread runs in this agent."""
        self.peers: dict[str, bytes] = {}
        self.leaked: list[Any] = []
        self._notifs: dict[str, list[bytes]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if config.progress_interval_s is not None and not self.native_progress:
            self._thread = threading.Thread(
                target=self._progress_loop, name=f"kvbridge-nixl-{config.name}", daemon=True
            )
            self._thread.start()

    # ----- memory and metadata -------------------------------------------------------------
    def metadata(self) -> bytes:
        with self.lock:
            md: bytes = self._agent.get_agent_metadata()
        return md

    def register_memory(self, rows: list[tuple[int, int, int, str]], device: str) -> Any:
        with self.lock:
            return self._agent.register_memory(rows, mem_type(device))

    def deregister_memory(self, reg_descs: Any) -> None:
        with self.lock:
            self._agent.deregister_memory(reg_descs)

    # ----- remote agents and prepped lists ---------------------------------------------------
    def add_peer(self, peer_name: str, peer_metadata: bytes) -> None:
        """Load a remote agent from its metadata; PeerError if it is not ``peer_name``'s."""
        with self.lock:
            try:
                loaded = self._agent.add_remote_agent(peer_metadata)
            except Exception as exc:
                raise PeerError(f"could not load metadata of {peer_name!r}: {exc!r}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer_name:
                self._agent.remove_remote_agent(name)
                raise PeerError(f"metadata is of agent {name!r}, expected {peer_name!r}")
            self.peers[peer_name] = peer_metadata

    def remove_peer(self, peer_name: str) -> None:
        with self.lock:
            if self.peers.pop(peer_name, None) is None:
                return
            try:
                self._agent.remove_remote_agent(peer_name)
            except Exception as exc:
                log.warning("removing peer %s: %r", peer_name, exc)

    def prep_dlists(
        self,
        peer_name: str,
        local_tables: Mapping[KVGroup, npt.NDArray[np.uint64]],
        local_device: str,
        remote_tables: Mapping[KVGroup, npt.NDArray[np.uint64]],
        remote_regions: Sequence[Region],
    ) -> dict[str, tuple[Any, Any]]:
        """Prep a (local, remote) descriptor list pair per group; all or none (PeerError)."""
        dlists: dict[str, tuple[Any, Any]] = {}
        with self.lock:
            try:
                for group, table in local_tables.items():
                    lh = self._agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", table, mem_type(local_device)
                    )
                    dev = remote_regions[0].device
                    rh = self._agent.prep_xfer_dlist(peer_name, remote_tables[group], mem_type(dev))
                    dlists[group] = (lh, rh)
            except Exception as exc:
                self.release_dlists(dlists)
                raise PeerError(
                    f"could not prepare descriptors for {peer_name!r}: {exc!r}; does its "
                    "metadata include the memory in its layout (register before exporting "
                    "metadata)?"
                ) from exc
        return dlists

    def release_dlists(self, dlists: Mapping[str, tuple[Any, Any]]) -> None:
        with self.lock:
            for pair in dlists.values():
                for dlist in pair:
                    try:
                        dlist.release()
                    except Exception as exc:
                        log.warning("releasing a prepped descriptor list: %r", exc)

    # ----- requests ------------------------------------------------------------------------
    def make_xfer(
        self, op: str, local_h: Any, local_idx: Any, remote_h: Any, remote_idx: Any, notify: bytes
    ) -> Any:
        with self.lock:
            return self._agent.make_prepped_xfer(
                op, local_h, local_idx, remote_h, remote_idx, notify
            )

    def start(self, xfer: Any) -> str:
        """Post ``xfer``: ``DONE``, ``PROC`` (in flight) or NIXL's word for a failure."""
        with self.lock:
            status: str = self._agent.transfer(xfer)
        return status

    def check(self, xfer: Any) -> str:
        """The state of a posted request; an exception comes back as ``error ...``."""
        try:
            with self.lock:
                status: str = self._agent.check_xfer_state(xfer)
        except Exception as exc:
            return f"error {exc!r}"
        return status

    def telemetry(self, xfer: Any) -> tuple[float, int, float] | None:
        """NIXL's own figures of a finished request: ``(seconds from post to completion,
        descriptors after merging adjacent ones, seconds the post itself took)``; the first
        equals the last when the transfer was done inside its post. None if NIXL has none."""
        try:
            with self.lock:
                t = self._agent.get_xfer_telemetry(xfer)
            return t.xferDuration / 1e6, int(t.descCount), t.postDuration / 1e6
        except Exception as exc:
            log.debug("no NIXL telemetry for a transfer: %r", exc)
            return None

    def release_xfer(self, xfer: Any) -> None:
        if xfer is None:
            return
        with self.lock:
            try:
                xfer.release()
            except Exception as exc:
                log.debug("transfer request not released yet (%r); retrying at close", exc)
                self.leaked.append(xfer)

    # ----- notifications and progress ----------------------------------------------------
    def send_notification(self, peer_name: str, message: bytes) -> None:
        with self.lock:
            try:
                self._agent.send_notif(peer_name, message)
            except Exception as exc:
                raise PeerError(f"notification to {peer_name!r} failed: {exc!r}") from exc

    def take_notifications(self) -> dict[str, list[bytes]]:
        """Messages received since the last call, by sending peer's agent name."""
        self.pump()
        with self.lock:
            out, self._notifs = self._notifs, {}
        return out

    def pump(self) -> None:
        try:
            with self.lock:
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
            self.pump()

    # ----- lifecycle -----------------------------------------------------------------------
    def stop_progress(self) -> None:
        """Stop and join the progress thread; call it without holding ``lock``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Release the requests left in ``leaked`` and drop the agent (peers unloaded first)."""
        with self.lock:
            for xfer in self.leaked:
                try:
                    xfer.release()
                except Exception as exc:
                    log.warning("a transfer request could not be released at close: %r", exc)
            self.leaked.clear()
            if self._agent is not None:
                # a request cancelled by a peer's death (a post that failed half-way) goes back
                # to UCX's pool only from a completion callback, run by progress: give it a
                # few rounds before the worker goes, or UCX reports it leaked
                for _ in range(CLOSE_PROGRESS_ROUNDS):
                    try:
                        self._agent.get_new_notifs()
                    except Exception as exc:
                        log.debug("progress at close: %r", exc)
                        break
            self._agent = None

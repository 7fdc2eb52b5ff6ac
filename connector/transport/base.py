"""The data-plane seam: move whole KV blocks between two processes' registered memory.

A :class:`Transport` lives in every kvbridge process that owns KV memory or
reads someone else's: the engine worker (the connector's worker side), the
offload daemon and the benchmark's target/reader processes. There is **one
transport per process**; it is created, used and closed by that process's
own code, never shared across processes. Peers find each other through the
control plane: each side sends :meth:`Transport.metadata` and its bound
:class:`~kvbridge.proto.layout.KVLayout` (``LocalMemory.layout.to_bytes()``)
and the reader calls :meth:`Transport.connect` with the other side's pair.

Calls are blocking. Several (``read_blocks`` on same-host CMA in particular)
block until the bytes have moved, so **never call a transport from an
asyncio event loop thread**: use :func:`wait_async` (which runs the wait in
a thread executor) or ``loop.run_in_executor`` for the whole transfer.

Policy lives elsewhere: the transport never decides which blocks move, never
pins and never evicts. It validates every id it is given against the
layouts before anything reaches the wire (every id a peer sends is
bounds-checked; the checks a transport makes are in :mod:`kvbridge.connector.transport.checks`).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import PeerError, TransferError
from kvbridge.proto.layout import KVGroup

if TYPE_CHECKING:
    import torch

    from kvbridge.proto.layout import KVLayout
    from kvbridge.proto.negotiate import TransferMode

__all__ = [
    "TransferOp",
    "TransferState",
    "LocalMemory",
    "PeerLink",
    "TransferHandle",
    "DeadlineHandle",
    "Transport",
    "LinkDownError",
    "wait_async",
]

TransferState = Literal["pending", "done", "failed"]


class LinkDownError(TransferError, PeerError):
    """The link was disconnected or its peer failed; reconnect with fresh metadata."""


@dataclass(frozen=True, slots=True)
class LocalMemory:
    """A registration made by :meth:`Transport.register`; owned by the registering process.

    ``layout`` is the layout bound to the registered addresses: send
    ``layout.to_bytes()`` to peers so they can connect to this memory.
    """

    memory_id: int
    layout: KVLayout
    device: str


@dataclass(frozen=True, slots=True)
class PeerLink:
    """A connection from one local memory to one remote memory, made by :meth:`Transport.connect`.

    ``descriptors_per_block`` is 1 for ``WHOLE_BLOCK`` and ``2 x owning layers``
    for ``PER_SPAN``; ``prep_s`` is how long preparing its descriptor lists took.
    """

    link_id: int
    peer_name: str
    local: LocalMemory
    remote_layout: KVLayout
    mode: TransferMode
    descriptors_per_block: int
    prep_s: float


@dataclass(frozen=True, slots=True)
class TransferOp:
    """One transfer to post over ``link``: ``READ`` moves the remote blocks ``remote_ids``
    into the local blocks ``local_ids`` of ``group``, ``WRITE`` the other way;
    ``notify`` reaches the owner once the transfer is done; ``timeout_s`` is kvbridge's
    own deadline (a hung peer never finishes a transfer)."""

    kind: Literal["READ", "WRITE"]
    link: PeerLink
    group: KVGroup
    local_ids: Sequence[int]
    remote_ids: Sequence[int]
    timeout_s: float
    notify: bytes | None = None


class TransferHandle(abc.ABC):
    """One posted transfer; owned by the thread that called read/write_blocks.

    The owner either waits for it or releases it; every path (done, failed,
    timed out, released early) frees the underlying request exactly once.
    """

    @abc.abstractmethod
    def poll(self) -> TransferState:
        """Non-blocking: drive progress once and say where the transfer is."""

    @abc.abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; raise TransferTimeoutError / TransferError (handle released)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Abandon or finish the transfer and free its request; idempotent."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this transfer moves."""

    @property
    @abc.abstractmethod
    def num_descriptors(self) -> int:
        """Descriptors in the request (before any merging by the backend)."""

    @property
    def wire_descriptors(self) -> int | None:
        """Descriptors the backend moved after merging adjacent ones, once done; None where
        the backend does not say."""
        return None

    @property
    def backend_seconds(self) -> float | None:
        """The backend's own timing of the transfer (post to completion), once done; None
        where the backend does not say. NIXL's is what vLLM's NixlConnector reports."""
        return None

    @property
    def backend_post_seconds(self) -> float | None:
        """Of :attr:`backend_seconds`, the post itself (all of it when the transfer was done
        inside its post, as a READ over CMA on one host is); None where the backend does
        not say."""
        return None


class DeadlineHandle(TransferHandle):
    """What a transport's handles share: their figures, kvbridge's own deadline, ``wait``.

    A subclass drives the transfer in :meth:`poll` (failing it once
    ``_deadline`` passed) and says in :meth:`_idle` how to pass the time
    between two polls of :meth:`wait`.
    """

    def __init__(self, deadline: float, nbytes: int, num_descriptors: int, what: str) -> None:
        self._deadline = deadline
        self._nbytes = nbytes
        self._ndesc = num_descriptors
        self._what = what
        self._state: TransferState = "pending"
        self._error: TransferError | None = None
        self._wire_desc: int | None = None
        self._backend_s: float | None = None
        self._backend_post_s: float | None = None

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_descriptors(self) -> int:
        return self._ndesc

    @property
    def wire_descriptors(self) -> int | None:
        return self._wire_desc

    @property
    def backend_seconds(self) -> float | None:
        return self._backend_s

    @property
    def backend_post_seconds(self) -> float | None:
        return self._backend_post_s

    @property
    def error(self) -> TransferError | None:
        return self._error

    def wait(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None:
            self._deadline = min(self._deadline, time.monotonic() + timeout_s)
        rounds = 0
        while (state := self.poll()) == "pending":
            self._idle(rounds)
            rounds += 1
        if state == "failed":
            assert self._error is not None
            raise self._error

    @abc.abstractmethod
    def _idle(self, rounds: int) -> None:
        """Pause after the ``rounds``-th (from 0) poll of :meth:`wait` that found it pending."""


class Transport(Closing, abc.ABC):
    """Moves blocks between registered KV memories of two processes; one per process.

    Lifecycle: ``register`` → ``metadata`` (send to peers) → ``connect`` →
    ``transfer`` (or its shorthands ``read_blocks``/``write_blocks``) and
    notifications → ``disconnect`` → ``unregister`` → ``close``. Register before
    exporting metadata: a peer only sees memory registered before it loaded our
    metadata. Use as a context manager.
    """

    @abc.abstractmethod
    def register(self, layout: KVLayout, kv_caches: Mapping[str, torch.Tensor]) -> LocalMemory:
        """Register every distinct memory region of ``kv_caches`` (aliases once)."""

    @abc.abstractmethod
    def unregister(self, memory: LocalMemory) -> None:
        """Deregister ``memory``; links that use it must be disconnected first."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """This process's agent metadata, for peers' :meth:`connect`."""

    @abc.abstractmethod
    def connect(
        self,
        peer_name: str,
        peer_metadata: bytes,
        remote_layout: KVLayout,
        local: LocalMemory,
    ) -> PeerLink:
        """Load the peer, negotiate the mode and prep descriptor lists; raises on mismatch."""

    @abc.abstractmethod
    def disconnect(self, link: PeerLink) -> None:
        """Drop the link's prepped lists; pending transfers on it fail with LinkDownError."""

    @abc.abstractmethod
    def transfer(self, op: TransferOp) -> TransferHandle:
        """Post ``op`` (ids checked against both layouts first); the caller owns the handle."""

    def read_blocks(
        self,
        link: PeerLink,
        group: KVGroup,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        *,
        notify: bytes | None = None,
        timeout_s: float,
    ) -> TransferHandle:
        """Post a READ of remote blocks into local blocks; ``notify`` reaches the owner."""
        return self.transfer(
            TransferOp("READ", link, group, local_ids, remote_ids, timeout_s, notify)
        )

    def write_blocks(
        self,
        link: PeerLink,
        group: KVGroup,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        *,
        notify: bytes | None = None,
        timeout_s: float,
    ) -> TransferHandle:
        """Post a WRITE of local blocks into remote blocks; ``notify`` reaches the owner."""
        return self.transfer(
            TransferOp("WRITE", link, group, local_ids, remote_ids, timeout_s, notify)
        )

    @abc.abstractmethod
    def send_notification(self, link: PeerLink, message: bytes) -> None:
        """Send ``message`` to the link's peer (e.g. "request X done, unpin")."""

    @abc.abstractmethod
    def poll_notifications(self) -> dict[str, list[bytes]]:
        """Messages received since the last call, by sending peer's agent name."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every handle, link and registration; idempotent."""


async def wait_async(handle: TransferHandle, timeout_s: float | None = None) -> None:
    """Await ``handle`` from asyncio code without blocking the event loop thread."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, handle.wait, timeout_s)

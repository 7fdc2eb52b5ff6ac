"""What a transport checks before it connects, posts or unregisters, kept out of its class.

Called by :class:`~kvbridge.connector.transport.nixl.NixlTransport` (in the
process that owns the transport): ids outside a layout, a mode no transport
moves directly, a peer's region of the wrong size, a link that is down,
memory still linked. Nothing here touches NIXL or UCX.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvbridge.connector.transport.base import LinkDownError, LocalMemory, PeerLink
from kvbridge.proto.errors import IncompatibleLayoutError, LayoutError, TransferError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode, negotiate

if TYPE_CHECKING:
    from kvbridge.proto.layout import KVLayout

__all__ = [
    "BlockRequest",
    "LinkStateView",
    "check_memory_unlinked",
    "check_remote_regions",
    "check_transfer_ids",
    "check_transfer_request",
    "checked_request",
    "link_mode",
    "live_state",
]


def check_transfer_ids(
    local: KVLayout,
    remote: KVLayout,
    group: KVGroup,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
) -> None:
    """Raise LayoutError/TransferError for any id or length that must not reach the wire.

    Called by every transport before it builds a request: lists must have
    equal length, and every id must be an int inside its side's group.
    """
    if len(local_ids) != len(remote_ids):
        raise TransferError(
            f"local_ids has {len(local_ids)} ids and remote_ids {len(remote_ids)}; "
            "they pair one to one and must have equal length"
        )
    local.check_block_ids(group, local_ids)
    remote.check_block_ids(group, remote_ids)


def check_transfer_request(
    link: PeerLink,
    group: KVGroup,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    notify: bytes | None,
    timeout_s: float,
) -> None:
    """Everything a transport checks before it posts a transfer on ``link``: a positive
    deadline, ids inside both layouts (:func:`check_transfer_ids`), ``notify`` as bytes."""
    if not timeout_s > 0:
        raise TransferError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    check_transfer_ids(link.local.layout, link.remote_layout, group, local_ids, remote_ids)
    if notify is not None and not isinstance(notify, bytes):
        raise TransferError(f"notify must be bytes, got {type(notify).__name__}")


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """The figures of one checked READ/WRITE, as the transport's ``_post`` uses them."""

    what: str
    per_span: bool
    descriptors_per_block: int
    nbytes: int
    num_descriptors: int
    deadline: float


def checked_request(
    op: str,
    link: PeerLink,
    group: KVGroup,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    notify: bytes | None,
    timeout_s: float,
) -> BlockRequest:
    """:func:`check_transfer_request`, then the request's figures; its deadline starts now."""
    from kvbridge.connector.transport.nixl_descs import descriptors_per_block

    check_transfer_request(link, group, local_ids, remote_ids, notify, timeout_s)
    deadline = time.monotonic() + timeout_s
    per_span = link.mode is TransferMode.PER_SPAN
    per = descriptors_per_block(link.local.layout, group, per_span)
    nbytes = link.local.layout.block_bytes(group)
    if link.mode is TransferMode.HEAD_SLICE:  # one span per page, the smaller side's page
        per = len(link.local.layout.owning_layers(group))
        nbytes = min(nbytes, link.remote_layout.block_bytes(group))
    return BlockRequest(
        what=f"{op} of {len(local_ids)} block(s) of {group!r} with {link.peer_name!r}",
        per_span=per_span,
        descriptors_per_block=per,
        nbytes=len(local_ids) * nbytes,
        num_descriptors=len(local_ids) * per,
        deadline=deadline,
    )


def link_mode(local: KVLayout, remote: KVLayout, *, head_slice: bool = False) -> TransferMode:
    """The mode a link from ``local`` to ``remote`` moves blocks in (:func:`negotiate`).

    Raises IncompatibleLayoutError for the modes no transport moves directly
    (``INCOMPATIBLE``, and ``REARRANGE``, which needs a staging buffer), and for
    ``HEAD_SLICE`` unless the transport builds slice tables (``head_slice``).
    """
    negotiation = negotiate(local, remote)
    if negotiation.mode is TransferMode.HEAD_SLICE and not head_slice:
        raise IncompatibleLayoutError(
            f"{negotiation.mode.value}: {negotiation.reason}; this transport moves no head slices"
        )
    if negotiation.mode in (TransferMode.INCOMPATIBLE, TransferMode.REARRANGE):
        raise IncompatibleLayoutError(
            f"{negotiation.mode.value}: {negotiation.reason}"
            + (
                "; stage through a buffer in the remote's order and convert locally"
                if negotiation.mode is TransferMode.REARRANGE
                else ""
            )
        )
    return negotiation.mode


def check_remote_regions(remote: KVLayout) -> None:
    """Raise LayoutError unless each of a peer's regions is as long as its layout says."""
    for i, region in enumerate(remote.regions):
        if region.length != remote.region_bytes(i):
            raise LayoutError(
                f"remote region {i} is {region.length} bytes, its layout says "
                f"{remote.region_bytes(i)}"
            )


class LinkStateView(Protocol):
    """What every transport's per-link state says: which link, and why it is down if so."""

    @property
    def link(self) -> PeerLink: ...

    @property
    def down(self) -> str | None: ...


_State = TypeVar("_State", bound=LinkStateView)


def live_state(link: PeerLink, state: _State | None) -> _State:
    """``state`` of ``link`` (None once disconnected); LinkDownError unless it is up."""
    if state is None:
        raise LinkDownError(f"link {link.link_id} to {link.peer_name!r} was disconnected")
    if state.down is not None:
        raise LinkDownError(
            f"link {link.link_id} to {link.peer_name!r} is down ({state.down}); "
            "connect again with the peer's fresh metadata"
        )
    return state


def check_memory_unlinked(memory: LocalMemory, states: Iterable[LinkStateView]) -> None:
    """Raise LayoutError if a link that is up still uses ``memory`` (before unregistering)."""
    for state in states:
        if state.link.local.memory_id == memory.memory_id and state.down is None:
            raise LayoutError(
                f"memory {memory.memory_id} is still used by link {state.link.link_id} "
                f"to {state.link.peer_name!r}; disconnect it first"
            )

"""Posting one group's block READ from a linked peer, and what it moved."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvbridge.connector.load.verify import Checked
from kvbridge.kernels import BlockMapping, convert_blocks
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.load.links import Peer
    from kvbridge.connector.load.verify import Expected
    from kvbridge.connector.transport.base import LocalMemory, TransferHandle, Transport

__all__ = ["ReadFigures", "read_blocks"]


class ReadFigures(NamedTuple):
    """What one finished READ moved, for :class:`~kvbridge.connector.base.LoadResult`."""

    nbytes: int
    descriptors: int
    wire_descriptors: int
    backend_s: float | None

    @classmethod
    def of(cls, handle: TransferHandle) -> ReadFigures:
        wire = handle.wire_descriptors
        return cls(
            handle.nbytes,
            handle.num_descriptors,
            handle.num_descriptors if wire is None else wire,
            handle.backend_seconds,
        )

    @staticmethod
    def total(reads: Sequence[ReadFigures]) -> dict[str, Any]:
        """``LoadResult`` keyword arguments for ``reads`` together."""
        times = [r.backend_s for r in reads]
        known = bool(times) and None not in times
        return {
            "bytes_moved": sum(r.nbytes for r in reads),
            "descriptors": sum(r.descriptors for r in reads),
            "wire_descriptors": sum(r.wire_descriptors for r in reads),
            "read_ms": sum(t for t in times if t is not None) * 1e3 if known else None,
        }


def read_blocks(
    transport: Transport,
    peer: Peer,
    group: KVGroup,
    local: list[BlockId],
    remote: list[BlockId],
    timeout_s: float,
    memory: LocalMemory,
    kv_caches: Mapping[str, torch.Tensor],
    expected: Expected | None = None,
) -> tuple[ReadFigures, Checked]:
    """READ ``remote`` into ``local`` (through the peer's staging cache if the inner orders
    differ) and check the blocks as they landed against ``expected``: only the leading
    blocks that match are converted out of the staging cache. Without ``expected`` every
    block counts as good."""
    staging = peer.staging
    if staging is None:
        read = _read_into(transport, peer, group, local, remote, timeout_s)
        return read, _check(expected, memory.layout, group, local)
    slots = staging.take(group, len(remote))  # OutOfBlocksError: the request recomputes
    try:
        read = _read_into(transport, peer, group, slots, remote, timeout_s)
        checked = _check(expected, staging.memory.layout, group, slots)
        if checked.good:
            convert_blocks(
                staging.caches,
                staging.memory.layout,
                kv_caches,
                memory.layout,
                BlockMapping(slots[: checked.good], local[: checked.good]),
                group=group,
            )
    finally:
        staging.give_back(group, slots)
    return read, checked


def _check(expected: Expected | None, layout: Any, group: KVGroup, ids: list[BlockId]) -> Checked:
    return Checked(len(ids), 0) if expected is None else expected.check(layout, group, ids)


def _read_into(
    transport: Transport,
    peer: Peer,
    group: KVGroup,
    local: list[BlockId],
    remote: list[BlockId],
    timeout_s: float,
) -> ReadFigures:
    handle = transport.read_blocks(peer.link, group, local, remote, timeout_s=timeout_s)
    try:
        handle.wait(timeout_s)
        return ReadFigures.of(handle)
    finally:
        handle.release()

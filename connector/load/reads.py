"""Posting a load's block READs from linked peers, all at once, and what they moved.

Every READ a load needs (each group, each TP rank's slice) is posted before the
first is waited for (:func:`post_reads`): on same-host CMA each completes inside
its post, elsewhere they are in flight together, and the load thread takes the
interpreter back once per load rather than once per READ.
"""

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
    from kvbridge.connector.transport.base import (
        LocalMemory,
        PeerLink,
        TransferHandle,
        Transport,
    )

__all__ = ["ReadFigures", "ReadRequest", "post_reads", "read_groups"]


class ReadFigures(NamedTuple):
    """What one finished READ moved, for :class:`~kvbridge.connector.base.LoadResult`."""

    nbytes: int
    descriptors: int
    wire_descriptors: int
    backend_s: float | None
    post_s: float | None = None
    """Of ``backend_s``, the post (all of it when the READ was done inside its post)."""

    @classmethod
    def of(cls, handle: TransferHandle) -> ReadFigures:
        wire = handle.wire_descriptors
        return cls(
            handle.nbytes,
            handle.num_descriptors,
            handle.num_descriptors if wire is None else wire,
            handle.backend_seconds,
            handle.backend_post_seconds,
        )

    @staticmethod
    def total(reads: Sequence[ReadFigures]) -> dict[str, Any]:
        """``LoadResult`` keyword arguments for ``reads`` together."""

        def ms(times: list[float | None]) -> float | None:
            known = bool(times) and None not in times
            return sum(t for t in times if t is not None) * 1e3 if known else None

        return {
            "bytes_moved": sum(r.nbytes for r in reads),
            "descriptors": sum(r.descriptors for r in reads),
            "wire_descriptors": sum(r.wire_descriptors for r in reads),
            "read_ms": ms([r.backend_s for r in reads]),
            "post_ms": ms([r.post_s for r in reads]),
        }


class ReadRequest(NamedTuple):
    """One READ of ``remote`` blocks over ``link`` into ``local`` blocks of ``group``."""

    link: PeerLink
    group: KVGroup
    local: list[BlockId]
    remote: list[BlockId]


def post_reads(
    transport: Transport, requests: Sequence[ReadRequest], timeout_s: float
) -> list[ReadFigures]:
    """Post every READ in ``requests``, then wait for them all (one deadline); the figures
    in order. A failed READ raises its error once every handle was released."""
    handles: list[TransferHandle] = []
    try:
        for r in requests:
            handles.append(
                transport.read_blocks(r.link, r.group, r.local, r.remote, timeout_s=timeout_s)
            )
        for handle in handles:
            handle.wait(timeout_s)
        return [ReadFigures.of(h) for h in handles]
    finally:
        for handle in handles:
            handle.release()


def read_groups(
    transport: Transport,
    peer: Peer,
    groups: Mapping[KVGroup, tuple[list[BlockId], list[BlockId]]],
    timeout_s: float,
    memory: LocalMemory,
    kv_caches: Mapping[str, torch.Tensor],
    expected: Expected | None = None,
) -> dict[KVGroup, tuple[ReadFigures, Checked]]:
    """READ each group's ``(local, remote)`` blocks, posted together (through the peer's
    staging cache if the inner orders differ), and check the blocks as they landed against
    ``expected``: only the leading blocks that match are converted out of the staging
    cache. Without ``expected`` every block counts as good."""
    staging = peer.staging
    slots: dict[KVGroup, list[BlockId]] = {}
    try:
        if staging is not None:  # OutOfBlocksError: the request recomputes
            for g, (_, remote) in groups.items():
                slots[g] = staging.take(g, len(remote))
        requests = [
            ReadRequest(peer.link, g, slots.get(g, local), remote)
            for g, (local, remote) in groups.items()
        ]
        figures = post_reads(transport, requests, timeout_s)
        out: dict[KVGroup, tuple[ReadFigures, Checked]] = {}
        for (g, (local, _)), read in zip(groups.items(), figures, strict=True):
            if staging is None:
                out[g] = read, _check(expected, memory.layout, g, local)
                continue
            checked = _check(expected, staging.memory.layout, g, slots[g])
            if checked.good:
                convert_blocks(
                    staging.caches,
                    staging.memory.layout,
                    kv_caches,
                    memory.layout,
                    BlockMapping(slots[g][: checked.good], local[: checked.good]),
                    group=g,
                )
            out[g] = read, checked
        return out
    finally:
        if staging is not None:
            for g, taken in slots.items():
                staging.give_back(g, taken)


def _check(expected: Expected | None, layout: Any, group: KVGroup, ids: list[BlockId]) -> Checked:
    return Checked(len(ids), 0) if expected is None else expected.check(layout, group, ids)

"""A staging cache for a worker whose inner order differs from the offload pool's.

Used by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process) when the handshake negotiates ``REARRANGE`` (e.g. a worker in an
``HND`` order and a pool in ``NHD``): NIXL moves whole blocks between the pool
and a small registered cache in the pool's order, and
:func:`kvbridge.kernels.convert_blocks` converts between that cache and the
engine's KV. Blocks move through it in chunks of its size, one transfer at a
time (its lock).

Digests are always over the bytes in the *pool's* inner order (what sits in the
daemon's memory): a storing worker digests the staged blocks, a loading one
checks the staged blocks before converting them into its KV.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.kernels import BlockMapping, convert_blocks
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import LocalMemory, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["STAGING_BLOCKS", "Staging", "chunks"]

STAGING_BLOCKS = 64
"""Blocks of an offload staging cache; longer stores and loads move in chunks of this."""


@dataclass(slots=True)
class Staging:
    """A registered cache in the pool's order; ``lock`` serialises its use."""

    memory: LocalMemory
    caches: Mapping[str, torch.Tensor]
    size: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def create(
        cls,
        transport: Transport,
        local: KVLayout,
        local_caches: Mapping[str, torch.Tensor],
        pool: KVLayout,
        group: KVGroup,
    ) -> Staging:
        """Allocate and register a cache like ``local`` in ``pool``'s order."""
        size = min(local.group(group).num_blocks, STAGING_BLOCKS)
        counts = {g.name: size if g.name == group else 1 for g in local.groups}
        layout = local.with_order(pool.order).with_num_blocks(**counts)
        device = next(iter(local_caches.values())).device.type
        caches = layout.allocate(device)
        return cls(transport.register(layout, caches), caches, size)

    def ids(self, n: int) -> list[BlockId]:
        """The first ``n`` staging blocks (``n`` at most :attr:`size`)."""
        assert n <= self.size
        return [BlockId(i) for i in range(n)]

    def pack(
        self,
        local: KVLayout,
        local_caches: Mapping[str, torch.Tensor],
        local_ids: Sequence[int],
        group: KVGroup,
    ) -> list[BlockId]:
        """Convert engine blocks ``local_ids`` into the first staging blocks; their ids."""
        staged = self.ids(len(local_ids))
        convert_blocks(
            local_caches,
            local,
            self.caches,
            self.memory.layout,
            BlockMapping(list(local_ids), staged),
            group=group,
        )
        return staged

    def unpack(
        self,
        local: KVLayout,
        local_caches: Mapping[str, torch.Tensor],
        local_ids: Sequence[int],
        group: KVGroup,
    ) -> None:
        """Convert the first staging blocks into engine blocks ``local_ids``."""
        convert_blocks(
            self.caches,
            self.memory.layout,
            local_caches,
            local,
            BlockMapping(self.ids(len(local_ids)), list(local_ids)),
            group=group,
        )


def chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``0..n`` in pieces of at most ``size``."""
    for start in range(0, n, size):
        yield start, min(n, start + size)

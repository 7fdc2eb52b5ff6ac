"""Moving blocks between a worker's KV and the offload pool over NIXL, with digests.

Used by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process) once it holds a :class:`Session`. :meth:`BlockMover.write` digests
the blocks it WRITEs (keyed XXH3-128 over the bytes as they are in the pool's
order) and :meth:`BlockMover.read` checks every block after its READ landed,
before the engine may use it. Through a staging cache when the worker's inner
order differs from the pool's (:mod:`kvbridge.connector.offload.staging`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.offload.session import GROUP, Session
from kvbridge.connector.offload.staging import chunks
from kvbridge.kernels import block_digests, span_digest

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import LocalMemory, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["BlockMover"]


class BlockMover:
    """NIXL transfers of one worker's blocks to and from its offload daemon's pool."""

    def __init__(
        self,
        transport: Transport,
        local: LocalMemory,
        caches: Mapping[str, torch.Tensor] | None,
        timeout_s: float,
    ) -> None:
        self._transport = transport
        self._local = local
        self._caches = caches
        self._timeout_s = timeout_s

    def transfer(
        self,
        op: str,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        notify: bytes | None = None,
    ) -> None:
        post = self._transport.write_blocks if op == "write" else self._transport.read_blocks
        handle = post(
            session.link,
            GROUP,
            local_ids,
            slots,
            notify=notify,
            timeout_s=self._timeout_s,
        )
        try:
            handle.wait()
        finally:
            handle.release()

    def write(
        self,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        notify: bytes,
        key: int,
    ) -> list[bytes]:
        """WRITE ``local_ids`` into ``slots`` (the last transfer carries ``notify``); returns
        the blocks' digests, taken over the bytes as they are in the pool's order."""
        staging = session.staging
        if staging is None:
            digests = block_digests(self._local.layout, GROUP, local_ids, key)
            self.transfer("write", session, local_ids, slots, notify)
            return digests
        assert self._caches is not None
        digests = []
        with staging.lock:
            for a, b in chunks(len(local_ids), staging.size):
                staged = staging.pack(self._local.layout, self._caches, local_ids[a:b], GROUP)
                digests += block_digests(staging.memory.layout, GROUP, staged, key)
                last = b == len(local_ids)
                self.transfer("write", session, staged, slots[a:b], notify if last else None)
        return digests

    def read(
        self,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        digests: Sequence[tuple[int, bytes]] | None,
    ) -> tuple[list[int], float]:
        """READ ``slots`` into ``local_ids``; returns the positions whose bytes failed their
        digest (none when ``digests`` is None: verification off) and the check's seconds."""
        staging = session.staging
        if staging is None:
            self.transfer("read", session, local_ids, slots)
            t0 = time.perf_counter()
            bad = _verify(self._local.layout, local_ids, digests, 0)
            return bad, time.perf_counter() - t0
        assert self._caches is not None
        bad, verify_s = [], 0.0
        with staging.lock:
            for a, b in chunks(len(local_ids), staging.size):
                staged = staging.ids(b - a)
                self.transfer("read", session, staged, slots[a:b])
                t0 = time.perf_counter()
                part = None if digests is None else digests[a:b]
                bad += _verify(staging.memory.layout, staged, part, a)
                verify_s += time.perf_counter() - t0
                staging.unpack(self._local.layout, self._caches, local_ids[a:b], GROUP)
        return bad, verify_s


def _verify(
    layout: KVLayout,
    block_ids: Sequence[int],
    digests: Sequence[tuple[int, bytes]] | None,
    first: int,
) -> list[int]:
    """Positions (from ``first``) of blocks whose bytes do not match their digest."""
    if digests is None:
        return []
    return [
        first + i
        for i, (block, (key, want)) in enumerate(zip(block_ids, digests, strict=True))
        if span_digest(layout.regions, layout.block_spans(GROUP, block), key) != want
    ]

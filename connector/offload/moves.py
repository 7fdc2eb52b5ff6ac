"""Moving blocks between a worker's KV and the offload pool over NIXL, with digests.

Used by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process) once it holds a :class:`Session`. :meth:`BlockMover.write` digests
the blocks it WRITEs (keyed, over the bytes as they are in the pool's order; the
algorithm travels with the digests) and :meth:`BlockMover.read` checks every block
after its READ landed, with its writer's algorithm, before the engine may use it.
Through a staging cache when the worker's inner order differs from the pool's
(:mod:`kvbridge.connector.offload.staging`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.offload.session import GROUP, Session
from kvbridge.connector.offload.staging import chunks
from kvbridge.kernels import block_digests, digest_algo
from kvbridge.kernels.digest import ALGO_DEVICE, ALGO_XXH3, DIGEST_BYTES
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto.errors import WireError

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import LocalMemory, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["BlockMover", "Digest", "load_digests"]

Digest = tuple[int, bytes, str]
"""A pool block's ``(key, digest, algo)`` as its writer recorded it."""


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
        algo: str | None = None,
    ) -> tuple[str, list[bytes]]:
        """WRITE ``local_ids`` into ``slots`` (the last transfer carries ``notify``); returns
        the blocks' digests, taken over the bytes as they are in the pool's order, and their
        algorithm (``algo``; default: the one for the memory digested, :func:`digest_algo`)."""
        staging = session.staging
        if staging is None:
            algo = algo or digest_algo(self._local.layout, GROUP)
            digests = block_digests(self._local.layout, GROUP, local_ids, key, algo)
            self.transfer("write", session, local_ids, slots, notify)
            return algo, digests
        assert self._caches is not None
        algo = algo or digest_algo(staging.memory.layout, GROUP)
        digests = []
        with staging.lock:
            for a, b in chunks(len(local_ids), staging.size):
                staged = staging.pack(self._local.layout, self._caches, local_ids[a:b], GROUP)
                digests += block_digests(staging.memory.layout, GROUP, staged, key, algo)
                last = b == len(local_ids)
                self.transfer("write", session, staged, slots[a:b], notify if last else None)
        return algo, digests

    def read(
        self,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        digests: Sequence[Digest] | None,
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


def load_digests(resp: pb.PrepareLoadResponse, n: int) -> list[Digest]:
    """PrepareLoad's per-slot ``(key, digest, algo)``, checked (no algorithm: XXH3, a daemon
    from before algorithms travelled)."""
    keys, digests, algos = list(resp.digest_keys), list(resp.digests), list(resp.digest_algos)
    algos = algos or [ALGO_XXH3] * n
    if len(keys) != n or len(digests) != n or len(algos) != n:
        raise WireError(
            f"PrepareLoad sent {len(keys)} keys and {len(digests)} digests for {n} slots"
        )
    if any(len(d) != DIGEST_BYTES for d in digests) or set(algos) - {ALGO_XXH3, ALGO_DEVICE}:
        raise WireError("PrepareLoad sent a digest of another size or an unknown algorithm")
    return list(zip(keys, map(bytes, digests), algos, strict=True))


def _verify(
    layout: KVLayout,
    block_ids: Sequence[int],
    digests: Sequence[Digest] | None,
    first: int,
) -> list[int]:
    """Positions (from ``first``) of blocks whose bytes do not match their digest (computed
    with the writer's algorithm)."""
    if digests is None:
        return []
    return [
        first + i
        for i, (block, (key, want, algo)) in enumerate(zip(block_ids, digests, strict=True))
        if block_digests(layout, GROUP, [block], key, algo)[0] != want
    ]

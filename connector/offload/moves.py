"""Moving blocks between a worker's KV and the offload pool over NIXL, with digests.

Used by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process) once it holds a :class:`Session`. :meth:`BlockMover.write` digests
the blocks it WRITEs (keyed, over the bytes as they are in the pool's order; the
algorithm travels with the digests) and :meth:`BlockMover.read` checks every block
after its READ landed, with its writer's algorithm, before the engine may use it.
Through a staging cache when the worker's inner order differs from the pool's
(:mod:`kvbridge.connector.offload.staging`).

Digesting costs about a fifth of a READ's time on the CPU, so a transfer of more than
:data:`PIPELINE_BYTES` goes in pieces of that size that overlap the digests: a store
digests piece *k + 1* while piece *k* is written, a verified load checks piece *k* (after
its READ finished) while piece *k + 1* is read. The transfers run one at a time on the
mover's one helper thread (NIXL's ``transfer()`` releases the GIL while CMA copies);
:meth:`BlockMover.close` stops it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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

__all__ = ["PIPELINE_BYTES", "BlockMover", "Digest", "load_digests"]

PIPELINE_BYTES = 8 << 20
"""Bytes per piece of a transfer whose digests are overlapped with it (see the module doc)."""

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
        self._helper: ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()

    def close(self) -> None:
        """Stop the helper thread (after the transfer it may be running); idempotent."""
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)

    def _post(
        self,
        op: str,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        notify: bytes | None = None,
    ) -> Future[None]:
        """:meth:`transfer` on the helper thread."""
        with self._helper_lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-offload-move")
            return self._helper.submit(self.transfer, op, session, local_ids, slots, notify)

    def _pieces(self, n: int) -> list[tuple[int, int]]:
        per = max(1, PIPELINE_BYTES // self._local.layout.block_bytes(GROUP))
        return list(chunks(n, per))

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
            pieces = self._pieces(len(local_ids))
            if len(pieces) == 1:
                digests = block_digests(self._local.layout, GROUP, local_ids, key, algo)
                self.transfer("write", session, local_ids, slots, notify)
                return algo, digests
            return algo, self._write_pipelined(session, local_ids, slots, notify, key, algo)
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
            pieces = self._pieces(len(local_ids))
            if digests is not None and len(pieces) > 1:
                return self._read_pipelined(session, local_ids, slots, digests, pieces)
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

    def _write_pipelined(
        self,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        notify: bytes,
        key: int,
        algo: str,
    ) -> list[bytes]:
        """Digest piece k + 1 while piece k is written; the last WRITE carries ``notify``."""
        digests: list[bytes] = []
        pending: Future[None] | None = None
        try:
            for a, b in self._pieces(len(local_ids)):
                digests += block_digests(self._local.layout, GROUP, local_ids[a:b], key, algo)
                if pending is not None:
                    pending.result()
                last = b == len(local_ids)
                pending = self._post(
                    "write", session, local_ids[a:b], slots[a:b], notify if last else None
                )
            assert pending is not None
            pending.result()
            pending = None
        finally:
            _settle(pending)
        return digests

    def _read_pipelined(
        self,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        digests: Sequence[Digest],
        pieces: list[tuple[int, int]],
    ) -> tuple[list[int], float]:
        """Check piece k (its READ finished) while piece k + 1 is read."""

        def read(a: int, b: int) -> Future[None]:
            return self._post("read", session, local_ids[a:b], slots[a:b])

        bad: list[int] = []
        verify_s = 0.0
        pending: Future[None] | None = read(*pieces[0])
        try:
            for k, (a, b) in enumerate(pieces):
                assert pending is not None
                pending.result()  # piece k landed (a failed READ raises here)
                pending = read(*pieces[k + 1]) if k + 1 < len(pieces) else None
                t0 = time.perf_counter()
                bad += _verify(self._local.layout, local_ids[a:b], digests[a:b], a)
                verify_s += time.perf_counter() - t0
        finally:
            _settle(pending)
        return bad, verify_s


def _settle(pending: Future[None] | None) -> None:
    """Wait for a transfer still running after an error (its memory is the caller's); its
    own outcome is not the error being raised."""
    if pending is not None:
        with contextlib.suppress(Exception):
            pending.result()


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

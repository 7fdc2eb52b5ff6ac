"""Moving blocks between a worker's KV and the offload pool over NIXL, with digests.

Used by :class:`~kvbridge.connector.offload.client.OffloadClient` (worker
process) once it holds a :class:`Session`. :meth:`BlockMover.write` digests
the blocks it WRITEs (keyed, over the bytes as they are in the pool's order; the
algorithm travels with the digests) and :meth:`BlockMover.read` checks every block
after its READ landed, with its writer's algorithm, before the engine may use it.
Through a staging cache when the worker's inner order differs from the pool's
(:mod:`kvbridge.connector.offload.staging`).

Digesting costs about a fifth of a READ's time on the CPU, so a transfer of more than
:data:`PIPELINE_BYTES` goes in pieces that overlap the digests: from
:data:`FIRST_PIECE_BYTES`, doubling up to :data:`MAX_PIECE_BYTES` (each piece costs NIXL
about 0.1-0.2 ms of CPU, so few and big ones; the small first piece is all of a store's
digest that is not overlapped), and a load's in reverse (its small last piece is all of its
check that is not overlapped). The overlap hides the digest only where a core is otherwise
idle: the digest is CPU work (a pass over the bytes from memory; a READ's landed bytes are
not in the cache), so on a machine with no idle core it adds its time whatever the order
(docs/DESIGN-NOTES.md, "What the digest costs"). The mover's
one helper thread runs all the pieces' transfers back to back, one job per store or load
(NIXL's ``transfer()`` copies on CMA inside the call and releases the GIL meanwhile),
while the calling thread digests: a store's helper WRITEs piece *k* as soon as the caller
has digested it (so no byte leaves before its digest is taken), and the caller runs at
most :data:`AHEAD_PIECES` pieces ahead of the WRITEs (a bound on the work done ahead of a
WRITE that may fail; a WRITE of bytes just digested costs no less CPU than a cold one,
measured from 2 to 16 MiB pieces); a verified load's caller checks piece *k* as soon
as its READ landed while the helper already reads the next ones. Neither side waits for
the other's round trip per piece. A store's caller hands the digests on (``on_digests``:
the client posts CommitStore then) before the last WRITEs complete.
:meth:`BlockMover.close` stops the helper.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvbridge.connector.offload.session import GROUP, Session
from kvbridge.connector.offload.staging import chunks
from kvbridge.kernels import block_digests, digest_algo
from kvbridge.kernels.digest import ALGO_DEVICE, ALGO_XXH3, DIGEST_BYTES, keyed_block_digests
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto.errors import WireError

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.transport.base import LocalMemory, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["PIPELINE_BYTES", "BlockMover", "Digest", "load_digests"]

PIPELINE_BYTES = 8 << 20
"""A transfer of more bytes goes in pieces that overlap its digests (see the module doc)."""
FIRST_PIECE_BYTES = 2 << 20
"""The first piece of a store (the last of a load) in pieces; later ones double..."""
MAX_PIECE_BYTES = 64 << 20
"""...up to this size (64 MiB: 8 pieces for 256 MiB instead of 19 at 16 MiB, 1-3 ms less CPU
per 256 MiB; a piece's check still takes a quarter of the next piece's READ)."""
AHEAD_PIECES = 2
"""A store's caller digests at most this many pieces not yet written (the one being written
included)."""
_POLL_S = 0.05

Digest = tuple[int, bytes, str]
"""A pool block's ``(key, digest, algo)`` as its writer recorded it."""
OnDigests = Callable[[str, list[bytes]], None]


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

    def _submit(self, job: Callable[[], None]) -> Future[None]:
        """Run ``job`` on the helper thread."""
        with self._helper_lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-offload-move")
            return self._helper.submit(job)

    def _pieces(self, n: int, small_last: bool = False) -> list[tuple[int, int]]:
        """One piece up to :data:`PIPELINE_BYTES`; beyond, pieces from
        :data:`FIRST_PIECE_BYTES` doubling up to :data:`MAX_PIECE_BYTES` (``small_last``:
        in reverse, so that what is left after the last transfer is small)."""
        block = self._local.layout.block_bytes(GROUP)
        if n * block <= PIPELINE_BYTES:
            return [(0, n)] if n else []
        size, top = max(1, FIRST_PIECE_BYTES // block), max(1, MAX_PIECE_BYTES // block)
        sizes: list[int] = []
        while sum(sizes) < n:
            sizes.append(min(size, n - sum(sizes)))
            size = min(max(top, size), size * 2)
        if small_last:
            sizes.reverse()
        ends = list(itertools.accumulate(sizes))
        return list(zip([0, *ends[:-1]], ends, strict=True))

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
        on_digests: OnDigests | None = None,
        known: Sequence[bytes | None] = (),
    ) -> tuple[str, list[bytes]]:
        """WRITE ``local_ids`` into ``slots`` (the last transfer carries ``notify``); returns
        the blocks' digests, taken over the bytes as they are in the pool's order, and their
        algorithm (``algo``; default: the one for the memory digested, :func:`digest_algo`).
        ``on_digests(algo, digests)`` is called as soon as every block is digested, before
        the last WRITEs complete (the store's commit goes out then). ``known``: digests
        already taken (:meth:`digest_while`), per block or None; not with a staging cache."""
        staging = session.staging
        tell = on_digests or (lambda algo, digests: None)
        if staging is None:
            algo = algo or digest_algo(self._local.layout, GROUP)
            pieces = self._pieces(len(local_ids))
            if len(pieces) == 1:
                digests = self._digests(local_ids, key, algo, known)
                tell(algo, digests)
                self.transfer("write", session, local_ids, slots, notify)
                return algo, digests
            return algo, self._write_pipelined(
                session, local_ids, slots, notify, key, algo, tell, known
            )
        assert self._caches is not None
        algo = algo or digest_algo(staging.memory.layout, GROUP)
        digests = []
        with staging.lock:
            for a, b in chunks(len(local_ids), staging.size):
                staged = staging.pack(self._local.layout, self._caches, local_ids[a:b], GROUP)
                digests += block_digests(staging.memory.layout, GROUP, staged, key, algo)
                last = b == len(local_ids)
                if last:
                    tell(algo, digests)
                self.transfer("write", session, staged, slots[a:b], notify if last else None)
        return algo, digests

    def digest_while(
        self, session: Session, block_ids: Sequence[int], key: int, done: Callable[[], bool]
    ) -> list[bytes]:
        """Digests (with ``key``) of the leading ``block_ids``, a piece at a time until
        ``done()``: a store digests while its PrepareStore is in flight and it would only
        wait. None ([]) where :meth:`write` digests otherwise (staging, device memory);
        an error stops it (:meth:`write` digests those blocks again, and raises there)."""
        layout = self._local.layout
        if session.staging is not None or digest_algo(layout, GROUP) != ALGO_XXH3:
            return []
        per = max(1, FIRST_PIECE_BYTES // layout.block_bytes(GROUP))
        out: list[bytes] = []
        with contextlib.suppress(Exception):
            while len(out) < len(block_ids) and not done():
                part = block_ids[len(out) : len(out) + per]
                out += block_digests(layout, GROUP, part, key, ALGO_XXH3)
        return out

    def _digests(
        self, ids: Sequence[int], key: int, algo: str, known: Sequence[bytes | None]
    ) -> list[bytes]:
        """Digests of ``ids``: ``known`` ones as given, the rest taken now."""
        if not known:
            return block_digests(self._local.layout, GROUP, ids, key, algo)
        need = [j for j, d in enumerate(known) if d is None]
        fresh = block_digests(self._local.layout, GROUP, [ids[j] for j in need], key, algo)
        out = list(known)
        for j, d in zip(need, fresh, strict=True):
            out[j] = d
        return [d for d in out if d is not None]

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
            pieces = self._pieces(len(local_ids), small_last=True)
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
        tell: OnDigests,
        known: Sequence[bytes | None],
    ) -> list[bytes]:
        """Digest the pieces here while the helper WRITEs each one already digested (at most
        :data:`AHEAD_PIECES` digested and not yet written); the last WRITE carries
        ``notify``; ``tell(algo, digests)`` once all are digested."""
        pieces = self._pieces(len(local_ids))
        digested: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: next piece is ready
        room = threading.Semaphore(AHEAD_PIECES)  # pieces digested and not yet written

        def writes() -> None:
            for a, b in pieces:
                if not digested.get():
                    return  # the caller failed: nothing more is written
                last = b == len(local_ids)
                self.transfer(
                    "write", session, local_ids[a:b], slots[a:b], notify if last else None
                )
                room.release()

        digests: list[bytes] = []
        job = self._submit(writes)
        finished = False
        try:
            for a, b in pieces:
                while not room.acquire(timeout=_POLL_S):
                    if job.done():
                        break
                if job.done():
                    job.result()  # a failed WRITE raises here, before more digesting
                digests += self._digests(local_ids[a:b], key, algo, known[a:b])
                if b == len(local_ids):
                    tell(algo, digests)  # before the last WRITE is even posted
                digested.put(True)
            job.result()
            finished = True
        finally:
            if not finished:
                digested.put(False)
                _settle(job)
        return digests

    def _read_pipelined(
        self,
        session: Session,
        local_ids: Sequence[int],
        slots: Sequence[int],
        digests: Sequence[Digest],
        pieces: list[tuple[int, int]],
    ) -> tuple[list[int], float]:
        """Check each piece here once its READ landed while the helper reads the next."""
        landed: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        stop = threading.Event()

        def reads() -> None:
            for a, b in pieces:
                if stop.is_set():
                    return  # the caller failed: its memory is its own again
                try:
                    self.transfer("read", session, local_ids[a:b], slots[a:b])
                except BaseException as exc:
                    landed.put(exc)
                    return
                landed.put(None)

        bad: list[int] = []
        verify_s = 0.0
        pending: Future[None] | None = self._submit(reads)
        try:
            for a, b in pieces:
                failed = landed.get()  # piece k landed, or the READ that failed
                if failed is not None:
                    raise failed
                t0 = time.perf_counter()
                bad += _verify(self._local.layout, local_ids[a:b], digests[a:b], a)
                verify_s += time.perf_counter() - t0
        finally:
            stop.set()
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
    if len(digests) != len(block_ids):
        raise ValueError(f"{len(digests)} digests for {len(block_ids)} blocks")
    keys = [key for key, _, _ in digests]
    algos = {algo for _, _, algo in digests}
    if len(algos) == 1:
        got = keyed_block_digests(layout, GROUP, block_ids, keys, algos.pop())
    else:  # blocks of writers with other algorithms: one at a time
        got = [
            keyed_block_digests(layout, GROUP, [b], [key], algo)[0]
            for b, (key, _, algo) in zip(block_ids, digests, strict=True)
        ]
    return [
        first + i for i, (d, (_, want, _)) in enumerate(zip(got, digests, strict=True)) if d != want
    ]

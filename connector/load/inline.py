"""A decode load driven from the engine's own thread.

A load run as a job on a thread pool needs the interpreter lock from that
thread at each of its steps (link lookup, posting the READs, the seal READ,
completion polls, the digest check, the release), while the engine's own thread
(vLLM's busy loop, the reference engine's model loop) mostly holds it: each
hand-off can cost up to the interpreter's switch interval (5 ms), several times
the whole READ. So a load whose links are made is driven by the engine's thread
itself (:class:`InlineLoad`): ``start_load_kv`` posts every READ (each group,
each TP rank's slice) and returns; each ``get_finished`` polls them without
blocking, posts the lease seals' READ once they all landed (that order is the
proof, :mod:`kvbridge.connector.control.seal`), checks the blocks against their
digests once those arrived (the Digests RPC's answer is taken by gRPC's own
thread, no thread of ours runs it) and reads the seals' verdict: the same step
as a load on the pool, :class:`~kvbridge.connector.load.sealed.SealProof`, polled.
Anything slow or blocking (a new link, the owner path, a retry) stays on the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.control.seal import RANKS_AT_ONCE
from kvbridge.connector.load.attempt import Attempt
from kvbridge.connector.load.reads import ReadFigures
from kvbridge.connector.load.sealed import SealProof
from kvbridge.connector.load.verify import Checked, expect_from, fetch_from_ranks
from kvbridge.proto.errors import TransferTimeoutError
from kvbridge.proto.layout import KVGroup

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from kvbridge.connector.base import BlockLoad
    from kvbridge.connector.config import ConnectorConfig
    from kvbridge.connector.control.seal_reader import SealReader
    from kvbridge.connector.load.links import LinkCache, Peer
    from kvbridge.connector.transport.base import PeerLink, TransferHandle, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["INLINE_LOADS", "SPIN_S", "Attempt", "InlineLoad", "start_inline"]

log = logging.getLogger(__name__)

INLINE_LOADS = 64
"""Loads one engine drives from its own thread at once; more wait on the load pool."""
HELPED_BLOCKS = 16
"""Blocks from which an inline load's check lets a second thread hash a share: below, the
engine's thread hashes them all (a few µs each) rather than wake one."""
HELPER_HASHES = False
"""Whether an inline load's check lets a second thread hash a share at all. Off:
python-xxhash releases the interpreter lock only for an input over 64 KiB, and a block is
hashed span by span (16 KiB spans in the 4-layer test model), so the helper hashes holding
the lock and only adds lock hand-offs: in ``bench vllm --models 4L`` (load 2-3, two
back-to-back pairs) the long rows' check took 1.60-1.61 ms with it and 0.98 ms without
(18-block short rows 0.39-0.47 vs 0.31-0.33). Turn on with a digest that releases the lock."""
SPIN_S = 1e-4
"""How long one ``get_finished`` may poll READs in flight back to back (for all its loads
together): one that lands within it is seen now rather than a step later."""


class InlineLoad:
    """A sealed load from ``peers`` (one, or each remote TP rank holding this rank's heads),
    straight into the KV cache of bound ``layout``; :meth:`poll` never blocks."""

    def __init__(
        self,
        job: Attempt,
        peers: Sequence[Peer],
        seals: SealReader,
        layout: KVLayout,
        timeout_s: float,
    ) -> None:
        self.job = job
        self.peers = list(peers)
        self._seals = seals
        self._layout = layout
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._handles: list[TransferHandle] = []
        self.reads: list[ReadFigures] | None = None
        """Each READ's figures once all landed: rank after rank, each rank's groups in order."""
        self.proof: SealProof | None = None
        """The seal READ, check and verdict, once every READ landed."""

    @property
    def held(self) -> list[bool] | None:
        """Each peer's seal verdict, once read."""
        return None if self.proof is None else self.proof.held

    @property
    def checked(self) -> dict[KVGroup, Checked] | None:
        """Each group's digest check (every block good when the load is not verified)."""
        return None if self.proof is None else self.proof.checked

    def post(self, transport: Transport) -> None:
        """Post every block READ (raises, with nothing left in flight, if one cannot be)."""
        job = self.job
        try:
            for peer in self.peers:
                for g in job.local:
                    self._handles.append(
                        transport.read_blocks(
                            peer.link, g, job.local[g], job.remote[g], timeout_s=self._timeout_s
                        )
                    )
        except BaseException:
            self.close()
            raise
        job.mark("post")

    def poll(self, spin_until: float = 0.0) -> bool:
        """Advance as far as possible without waiting (READs in flight are polled back to
        back until ``time.perf_counter()`` passes ``spin_until``); True once every READ
        landed, every seal was read and (if they all held) the blocks were checked. Raises
        a READ's error, a digest fetch's, or TransferTimeoutError past the load's deadline."""
        if self.reads is None:
            for handle in self._handles:
                state = _spin(handle, spin_until)
                if state == "pending":
                    return self._in_time()
                if state == "failed":
                    handle.wait(0)  # raises the READ's error
            self.reads = [ReadFigures.of(h) for h in self._handles]
            self._release_reads()
            self.job.mark("reads")
            # only now: the seal READ after the blocks landed proves them
            links: list[PeerLink] = [p.seal_link for p in self.peers]  # type: ignore[misc]
            self.proof = SealProof(self.job, links, self._seals, self._layout, self._timeout_s)
        assert self.proof is not None
        return self.proof.advance(spin_until) or self._in_time()

    def _in_time(self) -> bool:
        if time.monotonic() > self._deadline:
            raise TransferTimeoutError(
                f"load of request {self.job.load.request_id} did not finish in "
                f"{self._timeout_s:.1f}s"
            )
        return False

    def _release_reads(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.release()

    def close(self) -> None:
        """Release whatever is still in flight (idempotent)."""
        self._release_reads()
        if self.proof is not None:
            self.proof.close()


def _spin(handle: TransferHandle, until: float) -> str:
    state = handle.poll()
    while state == "pending" and time.perf_counter() < until:
        state = handle.poll()
    return state


def start_inline(
    load: BlockLoad,
    ranks: Sequence[int],
    links: LinkCache,
    seals: SealReader,
    layout: KVLayout,
    hashers: Executor,
    config: ConnectorConfig,
    transport: Transport,
) -> InlineLoad | None:
    """``load`` from its engine's ``ranks``, posted now if it can go on without blocking:
    linked ranks, a lease seal in the params, a seal table at every rank, blocks landing
    straight in the KV cache of bound ``layout``. None: it was not started (the caller runs
    the whole load on its pool, which handles every other case)."""
    if config.stall_before_read_s or not load.lease_id or not load.seal:
        return None
    if len(ranks) > RANKS_AT_ONCE:
        return None
    peers = [links.cached(load, rank) for rank in ranks]
    if any(p is None or p.seal_link is None or p.staging is not None for p in peers):
        return None
    linked = [p for p in peers if p is not None]
    job = Attempt(load, peer=linked[0], cached=True)
    if not job.local or any(len(job.remote[g]) != len(job.local[g]) for g in job.local):
        return None
    timeout = config.control_timeout_s
    try:
        if job.expected is not None and len(linked) > 1:
            if not load.digests_at_owner:
                return None  # whole-block digests cannot check slices: the pool says so
            job.expected = fetch_from_ranks(linked, load, timeout)
        elif job.expected is not None:
            blocks = sum(len(ids) for ids in job.local.values())
            helper = hashers if HELPER_HASHES and blocks >= HELPED_BLOCKS else None
            job.expected = expect_from(job.expected, load, linked[0], layout, helper, timeout)
            if job.expected is None:
                return None
        job.mark("expect")
        inline = InlineLoad(job, linked, seals, layout, config.load_timeout_s)
        inline.post(transport)
    except Exception as exc:  # e.g. a link just taken down: the pool's load handles it
        log.info("request %s: load not started inline (%s)", load.request_id, exc)
        return None
    return inline

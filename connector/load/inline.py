"""A decode load driven from the engine's own thread, and what every load carries while under way.

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
thread, no thread of ours runs it) and reads the seals' verdict. Anything slow
or blocking (a new link, the owner path, a retry) stays on the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.control.seal import RANKS_AT_ONCE
from kvbridge.connector.load.reads import ReadFigures
from kvbridge.connector.load.verify import Checked, Expected, expect_from, fetch_from_ranks
from kvbridge.proto.errors import TransferTimeoutError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId, LeaseId

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from kvbridge.connector.config import ConnectorConfig
    from kvbridge.connector.control.seal_reader import SealCheck, SealReader
    from kvbridge.connector.load.links import LinkCache, Peer
    from kvbridge.connector.transport.base import TransferHandle, Transport
    from kvbridge.proto.layout import KVLayout

__all__ = ["INLINE_LOADS", "SEAL_WAIT_S", "SPIN_S", "Attempt", "InlineLoad", "start_inline"]

log = logging.getLogger(__name__)

INLINE_LOADS = 64
"""Loads one engine drives from its own thread at once; more wait on the load pool."""
HELPED_BLOCKS = 16
"""Blocks from which an inline load's check lets a second thread hash a share: below, the
engine's thread hashes them all (a few µs each) rather than wake one."""
SEAL_WAIT_S = 0.05
"""How long a load reads again a seal whose nonce is in no probe slot yet before it asks
the owner: vLLM's prefill worker makes a lease, and seals it, at the engine step after its
scheduler's answer named it, and a decode can read before that step ran (an inline load
reads it again once per ``get_finished``, the pool's every ``SEAL_POLL_S``)."""
SPIN_S = 1e-4
"""How long one ``get_finished`` may poll READs in flight back to back (for all its loads
together): one that lands within it is seen now rather than a step later."""


@dataclass(slots=True)
class Attempt:
    """One load under way: what it reads, and what it holds that a failure must give back."""

    load: BlockLoad
    t0: float = field(default_factory=time.perf_counter)
    local: dict[KVGroup, list[BlockId]] = field(init=False)
    remote: dict[KVGroup, list[BlockId]] = field(init=False)
    peer: Peer | None = None
    cached: bool = False
    """Whether ``peer`` came from the link cache (it may be to a process since restarted)."""
    link_ms: float = 0.0
    """How long this load waited for a new link (handshake and warm-up); 0 when cached."""
    lease: LeaseId | None = None
    """The lease the owner named for this load: the only lease this load may release (the
    lease id in the params is a claim, maybe another request's)."""
    expected: Expected | None = field(init=False)
    """The digests the blocks must match (None: the load is not verified)."""
    steps: list[tuple[str, float]] = field(init=False)
    """``(step, time.perf_counter())`` as the load passed each step (the debug step timing)."""

    def __post_init__(self) -> None:
        load = self.load
        self.expected = Expected.of(load)
        groups = [g for g, ids in load.local_ids.items() if ids]
        self.local = {g: list(load.local_ids[g]) for g in groups}
        self.remote = {g: list(load.remote_ids.get(g, ())) for g in groups}
        self.steps = [("start", self.t0)]

    def mark(self, step: str) -> None:
        self.steps.append((step, time.perf_counter()))

    def done(self, result: LoadResult) -> LoadResult:
        """``result`` with this load's link time and steps."""
        self.mark("verdict")
        steps = tuple(sorted((*result.steps, *self.steps), key=lambda step: step[1]))
        return replace(result, link_ms=self.link_ms or result.link_ms, steps=steps)


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
        self._seal: SealCheck | None = None
        self._seal_until: float | None = None
        self.reads: list[ReadFigures] | None = None
        """Each READ's figures once all landed: rank after rank, each rank's groups in order."""
        self.held: list[bool] | None = None
        """Each peer's seal verdict, once read."""
        self.checked: dict[KVGroup, Checked] | None = None
        """Each group's digest check (every block good when the load is not verified)."""
        expected = job.expected
        self._by_seal = expected is not None and expected.by_seal
        """The blocks are proved by the seal's content tag (no digests to compare with)."""
        self._landed: dict[KVGroup, list[bytes]] | None = None
        """Their digests as they landed, for the tag (``_by_seal``)."""

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
        job = self.job
        if self.reads is None:
            for handle in self._handles:
                state = _spin(handle, spin_until)
                if state == "pending":
                    return self._in_time()
                if state == "failed":
                    handle.wait(0)  # raises the READ's error
            self.reads = [ReadFigures.of(h) for h in self._handles]
            self._release_reads()
            job.mark("reads")
            self._post_seals()  # only now: READ after the blocks landed, they prove them
        if self.checked is None and self._landed is None and self._ready():
            self._check()  # while the seal READ is in flight
        if self.held is None:
            assert self._seal is not None
            done = self._seal.poll()
            while not done and time.perf_counter() < spin_until:
                done = self._seal.poll()
            if not done:
                return self._in_time()
            if self._by_seal and self._landed is None:
                self._check()  # the digests of what landed make the tag the slot must hold
            tag, tagged = self._tag()
            held, absent = self._seal.verdict(tag, tagged=tagged)
            self._seal.close()
            self._seal = None
            now = time.monotonic()
            if self._seal_until is None:
                self._seal_until = now + SEAL_WAIT_S
            if any(a and not h for a, h in zip(absent, held, strict=True)) and (
                now < self._seal_until
            ):
                self._post_seals()  # not sealed yet: read it again at the next poll
                return self._in_time()
            self.held = held
            job.mark("seal")
            if self._by_seal and all(held):  # the content tag proved every block
                self.checked = {g: Checked(len(ids), 0) for g, ids in job.local.items()}
        if self.checked is None and all(self.held) and not self._by_seal:
            if not self._ready():
                return self._in_time()
            self._check()
        return True

    def _tag(self) -> tuple[bytes | None, bool]:
        """What :meth:`SealCheck.verdict` needs: the content tag over what landed, if the
        load is proved by it."""
        expected = self.job.expected
        if not self._by_seal or expected is None or self._landed is None:
            return None, False
        return expected.tag(self.job.load, self._layout, self._landed), True

    def _post_seals(self) -> None:
        job = self.job
        lease, seal = job.load.lease_id, job.load.seal
        links = [p.seal_link for p in self.peers if p.seal_link is not None]
        self._seal = self._seals.post(links, lease, seal, self._timeout_s)
        if self._seal is None:  # no lease id: no seal can hold
            self.held = [False] * len(self.peers)

    def _ready(self) -> bool:
        return self.job.expected is None or self._by_seal or self.job.expected.ready()

    def _check(self) -> None:
        job, expected = self.job, self.job.expected
        if self._by_seal:
            assert expected is not None
            self._landed = {
                g: expected.landed(self._layout, g, ids) for g, ids in job.local.items()
            }
            job.mark("check")
            return
        self.checked = {
            g: Checked(len(ids), 0) if expected is None else expected.check(self._layout, g, ids)
            for g, ids in job.local.items()
        }
        job.mark("check")

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
        if self._seal is not None:
            self._seal.close()
            self._seal = None


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
            helper = hashers if blocks >= HELPED_BLOCKS else None
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

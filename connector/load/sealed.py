"""The sealed path's one verdict step: once a load's block READs landed, READ its lease's
seal at each owner, check the blocks meanwhile, then judge.

:class:`SealProof` is that step for every sealed load of one owner or of several TP ranks
that read whole blocks: an :class:`~kvbridge.connector.load.inline.InlineLoad` (the
engine's thread) polls it and never waits, :func:`load_sealed` (a load on a pool thread)
drives it to the end, waiting. A seal that holds proves the blocks
(:mod:`kvbridge.connector.control.seal`) and the lease goes back by notification;
otherwise the caller asks the owner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.connector.control.seal import SEAL_POLL_S, SEAL_WAIT_S
from kvbridge.connector.load.verify import Checked
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId

if TYPE_CHECKING:
    from kvbridge.connector.base import LoadResult
    from kvbridge.connector.control.seal_reader import SealCheck, SealReader
    from kvbridge.connector.load.attempt import Attempt
    from kvbridge.connector.load.reads import ReadFigures
    from kvbridge.connector.transport.base import PeerLink
    from kvbridge.proto.layout import KVLayout

__all__ = ["SealProof", "load_sealed"]

log = logging.getLogger(__name__)

Done = dict[KVGroup, tuple["ReadFigures", Checked]]
ReadFn = Callable[[Mapping[KVGroup, tuple[list[BlockId], list[BlockId]]], bool], Done]
"""READs each group's ``(local, remote)`` blocks; checks them as they land if asked to."""


class SealProof:
    """The seal READ of ``job``'s lease at each of ``links`` (posted now: call it only once
    every block READ landed, which is the proof's order), the blocks' check and the verdict.

    The blocks are checked while the seal READs are in flight once their digests are in (a
    load proved by its seal's content tag digests what landed instead, for the tag); a
    load whose seal does not hold at some owner is not checked after all. ``checked``: the
    blocks were checked as they landed (staged through a staging cache), nothing to do."""

    def __init__(
        self,
        job: Attempt,
        links: Sequence[PeerLink],
        seals: SealReader,
        layout: KVLayout,
        timeout_s: float,
        checked: dict[KVGroup, Checked] | None = None,
    ) -> None:
        self.job = job
        self._layout = layout
        self._timeout_s = timeout_s
        self.held: list[bool] | None = None
        """Each owner's seal verdict, once settled."""
        self.checked = checked
        """Each group's digest check (every block good when the load is not verified)."""
        expected = job.expected
        self._by_seal = expected is not None and expected.by_seal and checked is None
        """The blocks are proved by the seal's content tag (no digests to compare with)."""
        self._landed: dict[KVGroup, list[bytes]] | None = None
        """Their digests as they landed, for the tag (``_by_seal``)."""
        self._waited = False
        load = job.load
        self._seal: SealCheck | None = None
        if load.lease_id and load.seal:
            self._seal = seals.post(links, load.lease_id, load.seal, timeout_s, SEAL_WAIT_S)
        if self._seal is None:  # no lease id: no seal can hold
            self.held = [False] * len(links)

    def advance(self, spin_until: float = 0.0, *, block: bool = False) -> bool:
        """Go on as far as possible; True once every seal was judged and, if they all held,
        the blocks checked. Polling (``block`` False) never waits: seal READs in flight are
        polled back to back until ``time.perf_counter()`` passes ``spin_until``, and an
        owner that has not sealed the lease yet is READ again at once (read at the next
        poll). Blocking waits for the READs and the digests, and :data:`SEAL_POLL_S` before
        each READ again. Raises a digest fetch's error."""
        meanwhile = self.held is None and self.checked is None and self._landed is None
        if meanwhile and (block or self._ready()):
            self._check()  # while the seal READ is in flight
        if self.held is None:
            seal = self._seal
            assert seal is not None
            if block:
                seal.wait(self._timeout_s)
            elif not _spin(seal, spin_until):
                self._first("seal pending")  # the step log: a seal READ seen done a poll later
                return False
            if self._by_seal and self._landed is None:
                self._check()  # the digests of what landed make the tag the slot must hold
            tag, tagged = self._tag()
            held = seal.settle(tag, tagged=tagged)
            if held is None:  # an owner has not sealed the lease yet: read it again
                self._first("seal absent")  # the step log: the wait for the owner's seal
                if block:
                    time.sleep(SEAL_POLL_S)
                seal.again()
                return False
            self.close()
            self.held = held
            self.job.mark("seal")
            if self._by_seal and all(held):  # the content tag proved every block
                self.checked = {g: Checked(len(ids), 0) for g, ids in self.job.local.items()}
        if self.checked is None and all(self.held) and not self._by_seal:
            if not block and not self._ready():
                return False
            self._check()
        return True

    def _first(self, step: str) -> None:
        """Mark ``step`` the first time the seal is not ready at a poll (the step log)."""
        if not self._waited:
            self._waited = True
            self.job.mark(step)

    def finish(self) -> None:
        """:meth:`advance` to the end, waiting."""
        while not self.advance(block=True):
            pass

    def _ready(self) -> bool:
        expected = self.job.expected
        return expected is None or self._by_seal or expected.ready()

    def _check(self) -> None:
        job, expected = self.job, self.job.expected
        if self._by_seal:
            assert expected is not None
            self._landed = {
                g: expected.landed(self._layout, g, ids) for g, ids in job.local.items()
            }
        else:
            self.checked = {
                g: Checked(len(ids), 0)
                if expected is None
                else expected.check(self._layout, g, ids)
                for g, ids in job.local.items()
            }
        job.mark("check")

    def _tag(self) -> tuple[bytes | None, bool]:
        """What :meth:`SealCheck.settle` needs: the content tag over what landed, if the
        load is proved by it."""
        expected = self.job.expected
        if not self._by_seal or expected is None or self._landed is None:
            return None, False
        return expected.tag(self.job.load, self._layout, self._landed), True

    def close(self) -> None:
        """Release the seal READs still in flight and their scratch slots (idempotent)."""
        if self._seal is not None:
            self._seal.close()
            self._seal = None


def _spin(seal: SealCheck, until: float) -> bool:
    done = seal.poll()
    while not done and time.perf_counter() < until:
        done = seal.poll()
    return done


def load_sealed(
    job: Attempt,
    reader: SealReader,
    read_blocks: ReadFn,
    layout: KVLayout,
    timeout_s: float,
    reader_of: tuple[int, int],
    verdict: Callable[[Done], LoadResult],
) -> LoadResult | None:
    """The load without a control RPC, on the calling (pool) thread: READ the claimed ids
    into bound ``layout``, then :class:`SealProof`; a seal that holds proves them and the
    lease goes back by notification (as reader ``reader_of``). None: no seal to check, or
    it did not hold (the caller then asks the owner, and reads again what the owner names)."""
    load, peer = job.load, job.peer
    assert peer is not None
    link = peer.seal_link
    if not load.lease_id or not load.seal or link is None:
        return None
    if any(len(job.remote[g]) != len(job.local[g]) for g in job.local):
        return None
    # every group's READ at once; blocks READ straight into the cache are checked while
    # the seal READ is in flight, staged blocks inside the read (before conversion)
    staged = peer.staging is not None
    done = read_blocks({g: (job.local[g], job.remote[g]) for g in job.local}, staged)
    job.mark("reads")
    checked = {g: c for g, (_, c) in done.items()} if staged else None
    proof = SealProof(job, [link], reader, layout, timeout_s, checked)
    try:
        proof.finish()
    finally:
        proof.close()
    assert proof.held is not None
    if not proof.held[0]:
        log.info("request %s: the lease's seal does not hold; asking its owner", load.request_id)
        return None
    assert proof.checked is not None
    reader.release(link, load.lease_id, *reader_of)
    job.mark("release")
    return verdict({g: (read, proof.checked[g]) for g, (read, _) in done.items()})

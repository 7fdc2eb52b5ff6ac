"""The sealed path of a load run on a pool thread: READ the claimed ids, then the lease's seal.

Called by :meth:`RemoteLoader._load <kvbridge.connector.load.RemoteLoader>` (a load the
engine's thread does not drive, :mod:`~kvbridge.connector.load.inline`). A seal that
holds proves the blocks (:mod:`kvbridge.connector.control.seal`) and the lease goes
back by notification; otherwise the caller asks the owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvbridge.connector.load.inline import SEAL_WAIT_S, Attempt
from kvbridge.connector.load.verify import Checked
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId

if TYPE_CHECKING:
    from kvbridge.connector.base import LoadResult
    from kvbridge.connector.control.seal_reader import SealReader
    from kvbridge.connector.load.reads import ReadFigures
    from kvbridge.proto.layout import KVLayout

__all__ = ["load_sealed"]

log = logging.getLogger(__name__)

Done = dict[KVGroup, tuple["ReadFigures", Checked]]
ReadFn = Callable[[Mapping[KVGroup, tuple[list[BlockId], list[BlockId]]], bool], Done]
"""READs each group's ``(local, remote)`` blocks; checks them as they land if asked to."""


def load_sealed(
    job: Attempt,
    reader: SealReader,
    read_blocks: ReadFn,
    layout: KVLayout,
    timeout_s: float,
    reader_of: tuple[int, int],
    verdict: Callable[[Done], LoadResult],
) -> LoadResult | None:
    """The load without a control RPC: READ the claimed ids into bound ``layout``, then the
    lease's seal; a seal that holds proves them and the lease goes back by notification
    (as reader ``reader_of``). None: no seal to check, or it did not hold (the caller then
    asks the owner, and reads again what the owner names)."""
    load, peer = job.load, job.peer
    assert peer is not None
    link = peer.seal_link
    if not load.lease_id or not load.seal or link is None:
        return None
    if any(len(job.remote[g]) != len(job.local[g]) for g in job.local):
        return None
    # every group's READ at once; blocks READ straight into the cache are checked while
    # the seal READ is in flight (staged blocks before conversion, inside the read). The
    # seal READ is posted only once the block READs are done: that order is the proof.
    direct = peer.staging is None
    wanted = {g: (job.local[g], job.remote[g]) for g in job.local}
    done = read_blocks(wanted, not direct)
    job.mark("reads")
    failed: list[BaseException] = []
    expected = job.expected
    by_seal = expected is not None and expected.by_seal
    landed: dict[KVGroup, list[bytes]] = {}

    def check() -> None:
        assert expected is not None
        try:
            for g, (read, _) in done.items():
                if by_seal:
                    landed[g] = expected.landed(layout, g, job.local[g])
                else:
                    done[g] = (read, expected.check(layout, g, job.local[g]))
        except BaseException as exc:  # re-raised below, after the seal READ finished
            failed.append(exc)

    def tag() -> bytes | None:
        assert expected is not None
        if failed or len(landed) != len(done):
            return None
        return expected.tag(load, layout, landed)

    holds = reader.holds(
        link,
        load.lease_id,
        load.seal,
        timeout_s,
        check if direct and expected is not None else None,
        tag if by_seal else None,
        wait_s=SEAL_WAIT_S,
    )
    job.mark("seal")
    if failed:
        raise failed[0]
    if holds and by_seal:  # the tag over what landed matched: every block is proved
        for g, (read, _) in done.items():
            done[g] = (read, Checked(len(job.local[g]), 0))
    if not holds:
        log.info("request %s: the lease's seal does not hold; asking its owner", load.request_id)
        return None
    reader.release(link, load.lease_id, *reader_of)
    job.mark("release")
    return verdict(done)

"""Loading one request from several remote TP ranks at once (heterogeneous TP, fail closed).

Called by :class:`~kvbridge.connector.load.RemoteLoader` in decode's
worker half when the prefill has ``k`` times this engine's TP size: rank ``r``
holds the heads of prefill ranks ``r * k .. r * k + k - 1``, so it READs each of
those ranks' pages into slice ``j`` of its own pages (``HEAD_SLICE`` links, one
per rank, see :func:`kvbridge.proto.negotiate.head_slices`).

Only the fast path proves such a load: every rank's blocks are READ (all
posted at once), then every rank's lease seal (all posted at once,
:mod:`kvbridge.connector.control.seal`); the load is good only if every seal
holds. Each rank whose seal held gets its lease back by notification. Anything
else (no seal in the params, a seal that does not hold, a READ or link failure)
reports every block bad: the engine recomputes, and the leases not given back
expire. There is no owner (slow) path across ranks yet.

With a digest key, each rank's digests (asked for beside the READs) check the
slice of this rank's pages it filled (:class:`~kvbridge.connector.load.verify.Expected`):
``self`` blocks are good up to the first block one of whose slices differs.
Digests in the params (whole blocks of one rank) cannot check slices: such a load
fails closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.control.seal import SEAL_WAIT_S
from kvbridge.connector.load.reads import ReadFigures, ReadRequest
from kvbridge.connector.load.result import link_suspect, load_result, unverifiable, verdict
from kvbridge.proto.errors import KVBridgeError, LeaseError
from kvbridge.proto.layout import KVGroup

if TYPE_CHECKING:
    from kvbridge.connector.control.seal_reader import SealReader
    from kvbridge.connector.load.links import LinkCache, Peer
    from kvbridge.connector.load.verify import Checked, Expected
    from kvbridge.proto.layout import KVLayout

__all__ = ["load_from_ranks", "ranks_failed", "ranks_proven"]

log = logging.getLogger(__name__)

ReadFn = Callable[[Sequence[ReadRequest]], list[ReadFigures]]
"""Posts every READ given, then waits for them all (:func:`.reads.post_reads`)."""


def load_from_ranks(
    load: BlockLoad,
    ranks: Sequence[int],
    links: LinkCache,
    seals: SealReader,
    read: ReadFn,
    timeout_s: float,
    forget: Callable[[str, Peer], None],
    expect: Callable[[Sequence[Peer]], Expected] | None = None,
    layout: KVLayout | None = None,
) -> LoadResult:
    """READ ``load``'s blocks from each of ``ranks`` of its engine and prove every rank's
    seal; never raises (fail closed: every block bad). With a digest key, ``expect``
    gives what the ranks' slices must match (asked for once the links are up) and the
    blocks landed in bound ``layout`` are checked."""
    if load.digest_key is not None and (not load.digests_at_owner or expect is None):
        return unverifiable(load)  # whole-block digests in the params cannot check slices
    groups = [g for g, ids in load.local_ids.items() if ids]
    local = {g: list(load.local_ids[g]) for g in groups}
    remote = {g: list(load.remote_ids.get(g, ())) for g in groups}
    t0 = time.perf_counter()
    peers: list[Peer] = []
    link_ms = 0.0
    try:
        if not load.lease_id or not load.seal:
            raise LeaseError("no lease seal in the params: a load across TP ranks needs one")
        if any(len(remote[g]) != len(local[g]) for g in groups):
            raise LeaseError("the params name fewer remote blocks than the load needs")
        got = [links.get(load, rank) for rank in ranks]
        peers = [p for p, _ in got]
        if not all(cached for _, cached in got):
            link_ms = (time.perf_counter() - t0) * 1e3
        if any(p.seal_link is None for p in peers):
            raise LeaseError("a TP rank publishes no lease seal table")
        expected = None if expect is None or load.digest_key is None else expect(peers)
        # every rank's slices at once, then (the proof's order) every rank's seal at once
        reads = read([ReadRequest(p.link, g, local[g], remote[g]) for p in peers for g in groups])
        # a vLLM prefill rank seals its lease an engine step after the id was handed out:
        # a rank that has not sealed it yet is read again for up to SEAL_WAIT_S
        seal_links = [p.seal_link for p in peers]
        held = seals.holds_all(
            seal_links,  # type: ignore[arg-type]
            load.lease_id,
            load.seal,
            timeout_s,
            wait_s=SEAL_WAIT_S,
        )
        for peer, ok in zip(peers, held, strict=True):
            if ok:  # proven ours: give it back; the others expire
                seals.release(peer.seal_link, load.lease_id)  # type: ignore[arg-type]
        checked = None
        if expected is not None and all(held):
            assert layout is not None
            checked = {g: expected.check(layout, g, local[g]) for g in groups}
        result = ranks_proven(load, t0, ranks, peers, held, reads, checked)
    except Exception as exc:
        if not isinstance(exc, KVBridgeError):
            log.exception("request %s: unexpected load failure", load.request_id)
        elif link_suspect(exc):
            for peer in peers:  # a link may be down: handshake again next time
                forget(load.remote_engine, peer)
        return ranks_failed(load, t0, str(exc) or repr(exc))
    return replace(result, link_ms=link_ms) if link_ms else result


def ranks_proven(
    load: BlockLoad,
    t0: float,
    ranks: Sequence[int],
    peers: Sequence[Peer],
    held: Sequence[bool],
    reads: Sequence[ReadFigures],
    checked: Mapping[KVGroup, Checked] | None,
) -> LoadResult:
    """The result of a load whose READs (``reads``: rank after rank, each rank's groups in
    order) landed and whose seals were read (``held``, per rank): good only if every seal
    held, and then (``checked``: the digest check of each group, None when not verified)
    ``self`` blocks up to the first bad one."""
    if not all(held):
        bad = [r for r, ok in zip(ranks, held, strict=True) if not ok]
        return ranks_failed(load, t0, f"the lease seal of TP rank(s) {bad} does not hold")
    local = {g: list(ids) for g, ids in load.local_ids.items() if ids}
    if checked is None:
        moved = {g: len(ids) for g, ids in local.items()}
        return load_result(load, t0, moved=moved, path="sealed", reads=reads)
    n = len(local)
    done = {g: (_merged(reads[i::n]), checked[g]) for i, g in enumerate(local)}
    address = peers[0].address if peers else load.remote_address
    return verdict(load, t0, local, done, "sealed", address=address, verified=True)


def _merged(reads: Sequence[ReadFigures]) -> ReadFigures:
    """One group's READs from every rank, as one."""
    total = ReadFigures.total(reads)
    read_ms, post_ms = total["read_ms"], total["post_ms"]
    return ReadFigures(
        total["bytes_moved"],
        total["descriptors"],
        total["wire_descriptors"],
        None if read_ms is None else read_ms / 1e3,
        None if post_ms is None else post_ms / 1e3,
    )


def ranks_failed(load: BlockLoad, t0: float, error: str) -> LoadResult:
    """A load across TP ranks that failed: every block recomputed."""
    log.warning(
        "request %s: load from %s's TP ranks failed: %s; recomputing",
        load.request_id,
        load.remote_engine,
        error,
    )
    return load_result(load, t0, bad=load.local_ids.get(KVGroup.SELF, ()), error=error)

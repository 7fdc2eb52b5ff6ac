"""The one place a :class:`~kvbridge.connector.base.LoadResult` is built."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from kvbridge.connector.base import BlockLoad, LoadResult
from kvbridge.connector.load.reads import ReadFigures
from kvbridge.connector.load.verify import Checked
from kvbridge.proto.errors import ControlPlaneError, TransferTimeoutError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockId

__all__ = ["link_suspect", "load_result", "timed_out", "unverifiable", "verdict"]

log = logging.getLogger(__name__)


def load_result(
    load: BlockLoad,
    t0: float,
    *,
    moved: Mapping[KVGroup, int] | None = None,
    bad: Sequence[BlockId] = (),
    error: str = "",
    path: str = "",
    reads: Sequence[ReadFigures] = (),
    requested: int | None = None,
    offloaded: int = 0,
    elapsed_ms: float | None = None,
    mismatches: int = 0,
    verified: bool = False,
    offload_bad_digest: int = 0,
) -> LoadResult:
    """What ``load`` did, started at ``t0`` (``time.perf_counter()``): ``moved`` blocks per
    group, ``bad`` local ids the engine recomputes. ``requested`` defaults to every local
    block of the load; ``elapsed_ms`` to the time since ``t0``."""
    moved = dict(moved or {})
    if requested is None:
        requested = sum(len(ids) for ids in load.local_ids.values())
    if elapsed_ms is None:
        elapsed_ms = (time.perf_counter() - t0) * 1e3
    return LoadResult(
        request_id=load.request_id,
        blocks_requested=requested,
        blocks_moved=sum(moved.values()),
        bad_block_ids=tuple(bad),
        transfer_ms=elapsed_ms,
        error=error,
        moved_by_group=moved,
        path=path,
        blocks_offloaded=offloaded,
        digest_mismatches=mismatches,
        verified=verified,
        offload_bad_digest=offload_bad_digest,
        **ReadFigures.total(reads),
    )


def verdict(
    load: BlockLoad,
    t0: float,
    local: Mapping[KVGroup, Sequence[BlockId]],
    done: Mapping[KVGroup, tuple[ReadFigures, Checked]],
    path: str,
    error: str = "",
    *,
    address: str,
    verified: bool,
) -> LoadResult:
    """The result of a load whose READs ``done`` landed (and were checked): ``self`` blocks
    are good up to the first one not read or not matching its digest; a cross group not
    read whole and good makes every block bad (``error`` says why, if the caller knows).
    A digest mismatch is logged with the peer (engine and ``address``)."""
    local_self = list(local.get(KVGroup.SELF, ()))
    good = {g: checked.good for g, (_, checked) in done.items()}
    mismatches = sum(checked.mismatches for _, checked in done.values())
    if mismatches:
        error = (
            f"digest mismatch: {mismatches} block(s) read from {load.remote_engine} at "
            f"{address} differ from the digests recorded at hand-over"
        )
        log.warning("request %s: %s; recomputing them", load.request_id, error)
    moved = {g: n for g, n in good.items() if g == KVGroup.SELF or n == len(local[g])}
    bad = local_self[good.get(KVGroup.SELF, 0) :]
    # other groups (cross attention, a hybrid model's further attention groups) are all or
    # nothing: one not read whole makes the whole request recompute
    short = [g for g in local if g != KVGroup.SELF and moved.get(g) != len(local[g])]
    if short:
        bad, error = local_self, error or f"{short[0]} blocks not read whole"
    return load_result(
        load,
        t0,
        moved=moved,
        bad=bad,
        error=error,
        path=path,
        reads=[r for r, _ in done.values()],
        mismatches=mismatches,
        verified=verified,
    )


def unverifiable(load: BlockLoad) -> LoadResult:
    """A load with a digest key that reads head slices (heterogeneous TP) but carries its
    digests in the params (whole blocks only, no owner to ask for head digests): they
    cannot check a slice, so it fails closed (every block recomputed)."""
    error = "head-slice load with whole-block digests in the params cannot be verified: recomputing"
    log.info("request %s: %s", load.request_id, error)
    return load_result(
        load, time.perf_counter(), bad=load.local_ids.get(KVGroup.SELF, []), error=error
    )


ANSWERED = frozenset(
    {
        "ABORTED",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "OUT_OF_RANGE",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
    }
)
"""gRPC codes a peer answers with over a working channel: a refusal, not a broken link."""


def link_suspect(exc: BaseException) -> bool:
    """Whether a failed load's error says its link may be broken, so the link is dropped
    and the next load handshakes again. A peer's refusal (lease gone, too busy, a request
    it rejects) came over a working link: dropping it would fail every other load in flight
    on it for nothing. Anything else (a transfer or peer failure, a deadline, a malformed
    answer, a bug) is suspect."""
    if isinstance(exc, ControlPlaneError):
        return exc.code not in ANSWERED
    return True


def timed_out(exc: Exception) -> bool:
    """Whether ``exc`` is a deadline that passed (the peer hangs; a restart fails fast)."""
    return isinstance(exc, TransferTimeoutError) or (
        isinstance(exc, ControlPlaneError) and exc.code == "DEADLINE_EXCEEDED"
    )

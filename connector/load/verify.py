"""Checking blocks as they landed against the digests their owner recorded at hand-over.

Registered memory can be written by anyone holding its NIXL metadata, and a
seal slot is registered memory too; so after a READ lands, and before the
engine may use or cache a block (for ``REARRANGE``: in the staging cache, before
conversion), each block's keyed digest is recomputed over the bytes as read and
compared with the one in the load (from the kv_transfer_params, which no NIXL
peer can write). See docs/DESIGN-NOTES.md, "Trust: verified loads".
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvbridge.connector.control.seal import content_tag
from kvbridge.kernels import ALGO_XXH3, block_digests, digest_algo, page_slice_digests
from kvbridge.proto.errors import WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode, head_slices
from kvbridge.proto.types import LeaseId

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from kvbridge.connector.base import BlockLoad
    from kvbridge.connector.control.leases import HandOverDigests
    from kvbridge.connector.load.links import Peer
    from kvbridge.proto.layout import KVLayout
    from kvbridge.proto.types import BlockId

__all__ = [
    "Checked",
    "Expected",
    "expect_from",
    "fetch_expected",
    "fetch_from_ranks",
    "proved_by_seal",
]


log = logging.getLogger(__name__)


class PendingDigests(Protocol):
    """Digests on their way (:meth:`ControlClient.digests_call`, or a future)."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> HandOverDigests: ...


class Checked(NamedTuple):
    """What one group's check found."""

    good: int
    """Leading blocks whose digests match (the engine may use these)."""
    mismatches: int
    """Blocks whose digests differ (or have no digest to compare with)."""


@dataclass(frozen=True, slots=True)
class Expected:
    """The digests one load's blocks must have, under the hand-over's key.

    ``pending``: the digests are still on their way from the owner's control server
    (:meth:`fetching`); the first check waits for them. A fetch that failed raises from
    :meth:`check` (the load fails closed: every block is recomputed)."""

    key: int
    digests: Mapping[KVGroup, Sequence[bytes]]
    algo: str | None = None
    pending: PendingDigests | None = None
    first_block: int = 0
    """Where the load's ``self`` blocks start in the owner's lease (fetched digests cover it
    all)."""
    head_slice: tuple[int, int] | None = None
    """``(part, parts)``: this reader's heads are slice ``part`` of ``parts`` of each of the
    owner's pages (a bigger TP size reading a smaller one); checked against the owner's
    head digests."""
    ranks: tuple[PendingDigests, ...] = ()
    """The digests of each remote TP rank whose whole pages fill slice ``j`` of this
    reader's pages (a smaller TP size reading a bigger one), rank after rank."""
    helper: Executor | None = None
    """A thread that may hash a share of the blocks beside the checking thread
    (:func:`kvbridge.kernels.block_digests`)."""
    offsets: Mapping[KVGroup, int] | None = None
    """Per group, where the load's blocks start in the owner's lease (fetched digests cover
    it all): :meth:`BlockLoad.lease_offset`; None: ``first_block`` for ``self``, else 0."""
    by_seal: bool = False
    """The digests are not asked for: the blocks' bytes are proved by the content tag of
    their lease's seal (:meth:`landed` makes the digests the tag is checked with); if the
    seal does not hold, the load asks the owner after all (:func:`expect_from`)."""

    @classmethod
    def of(cls, load: BlockLoad) -> Expected | None:
        """The load's digests; None when it is not verified."""
        if load.digest_key is None:
            return None
        return cls(load.digest_key, load.digests, load.digest_algo)

    @classmethod
    def fetching(
        cls,
        load: BlockLoad,
        pending: PendingDigests,
        head_slice: tuple[int, int] | None = None,
    ) -> Expected:
        """The load's key, with the digests the owner will send (``pending``)."""
        assert load.digest_key is not None
        offsets = {g: load.lease_offset(g) for g in load.local_ids}
        return cls(
            load.digest_key, {}, None, pending, load.first_block, head_slice, offsets=offsets
        )

    @classmethod
    def from_ranks(cls, load: BlockLoad, pending: Sequence[PendingDigests]) -> Expected:
        """The load's key, with the digests each remote rank will send (rank ``j``'s whole
        pages are slice ``j`` of this reader's)."""
        assert load.digest_key is not None
        offsets = {g: load.lease_offset(g) for g in load.local_ids}
        return cls(
            load.digest_key, {}, None, None, load.first_block, None, tuple(pending), offsets=offsets
        )

    def ready(self) -> bool:
        """Whether :meth:`check` would not wait for digests still on their way."""
        pending = [self.pending] if self.pending is not None else list(self.ranks)
        return all(p.done() for p in pending)

    def _want(self, group: KVGroup, n: int) -> tuple[list[bytes], str | None]:
        if self.pending is None:
            return list(self.digests.get(group, ()))[:n], self.algo
        got = self.pending.result()  # the fetch has its own deadline; its error fails the load
        first = self._first(group)
        return list(got.groups.get(group, ()))[first : first + n], got.algo

    def _first(self, group: KVGroup) -> int:
        """Where the load's ``group`` blocks start in the owner's lease."""
        default = self.first_block if group == KVGroup.SELF else 0
        return default if self.offsets is None else self.offsets.get(group, default)

    def landed(self, layout: KVLayout, group: KVGroup, ids: Sequence[BlockId]) -> list[bytes]:
        """The digests, under this load's key, of blocks ``ids`` of bound ``layout`` as they
        landed (this reader's algorithm for its memory), for the seal's content tag."""
        return block_digests(layout, group, list(ids), self.key, None, self.helper)

    def tag(
        self, load: BlockLoad, layout: KVLayout, landed: Mapping[KVGroup, Sequence[bytes]]
    ) -> bytes | None:
        """The content tag ``load``'s seal must hold if the blocks that landed in bound
        ``layout`` (their :meth:`landed` digests) are the owner's; None if none can be made
        (the seal then does not hold, and the owner is asked)."""
        try:
            algo = digest_algo(layout, KVGroup.SELF)
            return content_tag(load.lease_id, load.seal, self.key, algo, landed)
        except Exception as exc:
            log.info("request %s: no content tag (%s)", load.request_id, exc)
            return None

    def check(self, layout: KVLayout, group: KVGroup, ids: Sequence[BlockId]) -> Checked:
        """Digest blocks ``ids`` of bound ``layout`` (where they landed) and compare them,
        in order, with this group's first ``len(ids)`` digests."""
        if self.head_slice is not None or self.ranks:
            return self._check_slices(layout, group, ids)
        want, algo = self._want(group, len(ids))
        if len(want) != len(ids):  # fail closed: a block without a digest is not used
            return Checked(0, len(ids))
        try:
            got = block_digests(layout, group, list(ids), self.key, algo, self.helper)
        except ValueError as exc:  # an algorithm this reader does not know
            raise WireError(f"cannot check the blocks: {exc}") from None
        bad = [
            i
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            if not hmac.compare_digest(a, b)
        ]
        return Checked(bad[0] if bad else len(ids), len(bad))

    def _check_slices(self, layout: KVLayout, group: KVGroup, ids: Sequence[BlockId]) -> Checked:
        """:meth:`check` for head slices: each of a block's slices against the digest its
        writer recorded for exactly those bytes; a block is good if every slice matches."""
        first = self._first(group)
        n = len(ids)
        if self.ranks:  # slice j of each page: rank j's whole pages
            fetched = [f.result() for f in self.ranks]  # a failed fetch fails the load
            parts = len(fetched)
            want = [list(got.groups.get(group, ()))[first : first + n] for got in fetched]
            algos = {got.algo for got in fetched}
            whole = all(len(w) == n for w in want)
            rows = [[w[i] for w in want] for i in range(n)] if whole else []
        else:
            assert self.head_slice is not None and self.pending is not None
            part, k = self.head_slice
            got = self.pending.result()
            parts = layout.sizes(group)["H"]  # one digest per head of this group's pages
            flat = list(got.head_groups.get(group, ()))
            algos = {ALGO_XXH3}
            rows = []
            if got.heads == parts * k and len(flat) >= (first + n) * got.heads:
                rows = [flat[(first + i) * got.heads + part * parts :][:parts] for i in range(n)]
        if len(rows) != n or len(algos) != 1:  # fail closed: a slice without a digest
            return Checked(0, n)
        try:
            have = page_slice_digests(layout, group, list(ids), self.key, parts, algos.pop())
        except ValueError as exc:  # e.g. a device writer: no slice digests to compare with
            raise WireError(f"cannot check the head slices: {exc}") from None
        bad = [
            i
            for i, (a, b) in enumerate(zip(have, rows, strict=True))
            if not all(hmac.compare_digest(x, y) for x, y in zip(a, b, strict=True))
        ]
        return Checked(bad[0] if bad else n, len(bad))


def expect_from(
    expected: Expected,
    load: BlockLoad,
    peer: Peer,
    layout: KVLayout,
    pool: Executor | None,
    timeout_s: float,
    *,
    ask: bool = False,
) -> Expected | None:
    """What ``load``'s blocks read from ``peer`` into bound ``layout`` must match:
    ``expected`` (the params' digests) or, when the owner keeps them, the owner's, asked
    for now (its head digests, for a head-slice link); a thread of ``pool`` (if any) helps
    hash the blocks. None: the link reads head slices but the digests in the params are of
    whole blocks, so the load cannot be verified. A load its seal's content tag can prove
    (:func:`proved_by_seal`) asks for nothing, unless ``ask`` (its seal did not hold)."""
    sliced = peer.link.mode is TransferMode.HEAD_SLICE
    if load.digests_at_owner and not ask and proved_by_seal(load, peer):
        return replace(expected, by_seal=True, helper=pool)  # no Digests round trip
    if load.digests_at_owner:
        part = head_slices(layout, peer.link.remote_layout)[1] if sliced else None
        expected = fetch_expected(peer, load, timeout_s, part)
    elif sliced:
        return None
    return replace(expected, helper=pool)


def fetch_expected(
    peer: Peer,
    load: BlockLoad,
    timeout_s: float,
    head_slice: tuple[int, int] | None = None,
) -> Expected:
    """The load's key with the digests its owner keeps, asked for now (the RPC is in flight
    beside the READs, its answer taken by gRPC's own thread; the first check waits for it).
    Without a lease id there is nothing to ask for: no block has a digest, so none is used
    (fail closed). ``head_slice``: the
    load reads slice ``(part, parts)`` of each of the owner's pages (checked against its
    head digests)."""
    assert load.digest_key is not None
    if not load.lease_id:
        return Expected(load.digest_key, {})
    pending = peer.client.digests_call(LeaseId(load.lease_id), timeout_s=timeout_s)
    return Expected.fetching(load, pending, head_slice)


def fetch_from_ranks(peers: Sequence[Peer], load: BlockLoad, timeout_s: float) -> Expected:
    """:func:`fetch_expected` for a load that fills slice ``j`` of each page from
    ``peers[j]`` (each rank digested its own pages under the hand-over's one key)."""
    assert load.digest_key is not None
    if not load.lease_id:
        return Expected(load.digest_key, {})
    lease = LeaseId(load.lease_id)
    pending = [p.client.digests_call(lease, timeout_s=timeout_s) for p in peers]
    return Expected.from_ranks(load, pending)


def proved_by_seal(load: BlockLoad, peer: Peer | None) -> bool:
    """Whether a verified load's bytes can be proved by its lease seal's content tag: the
    owner keeps the digests, the load reads every leased block straight into the KV cache
    (no staging, no head slices) and the peer has a seal table."""
    return (
        peer is not None
        and load.digests_at_owner
        and load.whole_lease
        and bool(load.seal and load.lease_id)
        and peer.seal_link is not None
        and peer.staging is None
        and peer.link.mode is not TransferMode.HEAD_SLICE
    )

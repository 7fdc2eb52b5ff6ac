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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from kvbridge.kernels import block_digests
from kvbridge.proto.errors import WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import LeaseId

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future

    from kvbridge.connector.base import BlockLoad
    from kvbridge.connector.control.leases import HandOverDigests
    from kvbridge.connector.load.links import Peer
    from kvbridge.proto.layout import KVLayout
    from kvbridge.proto.types import BlockId

__all__ = ["Checked", "Expected", "fetch_expected"]


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
    pending: Future[HandOverDigests] | None = None
    offsets: Mapping[KVGroup, int] | None = None
    """Per group, where the load's blocks start in the owner's lease (fetched digests cover
    it all): :meth:`BlockLoad.lease_offset`."""

    @classmethod
    def of(cls, load: BlockLoad) -> Expected | None:
        """The load's digests; None when it is not verified."""
        if load.digest_key is None:
            return None
        return cls(load.digest_key, load.digests, load.digest_algo)

    @classmethod
    def fetching(cls, load: BlockLoad, pending: Future[HandOverDigests]) -> Expected:
        """The load's key, with the digests the owner will send (``pending``)."""
        assert load.digest_key is not None
        offsets = {g: load.lease_offset(g) for g in load.local_ids}
        return cls(load.digest_key, {}, None, pending, offsets)

    def _want(self, group: KVGroup, n: int) -> tuple[list[bytes], str | None]:
        if self.pending is None:
            return list(self.digests.get(group, ()))[:n], self.algo
        got = self.pending.result()  # the fetch has its own deadline; its error fails the load
        first = (self.offsets or {}).get(group, 0)
        return list(got.groups.get(group, ()))[first : first + n], got.algo

    def check(self, layout: KVLayout, group: KVGroup, ids: Sequence[BlockId]) -> Checked:
        """Digest blocks ``ids`` of bound ``layout`` (where they landed) and compare them,
        in order, with this group's first ``len(ids)`` digests."""
        want, algo = self._want(group, len(ids))
        if len(want) != len(ids):  # fail closed: a block without a digest is not used
            return Checked(0, len(ids))
        try:
            got = block_digests(layout, group, list(ids), self.key, algo)
        except ValueError as exc:  # an algorithm this reader does not know
            raise WireError(f"cannot check the blocks: {exc}") from None
        bad = [
            i
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            if not hmac.compare_digest(a, b)
        ]
        return Checked(bad[0] if bad else len(ids), len(bad))


def fetch_expected(pool: Executor, peer: Peer, load: BlockLoad, timeout_s: float) -> Expected:
    """The load's key with the digests its owner keeps, asked for on ``pool`` (concurrently
    with the READ; the first check waits for them). Without a lease id there is nothing to
    ask for: no block has a digest, so none is used (fail closed)."""
    assert load.digest_key is not None
    if not load.lease_id:
        return Expected(load.digest_key, {})
    pending = pool.submit(peer.client.digests, LeaseId(load.lease_id), timeout_s=timeout_s)
    return Expected.fetching(load, pending)

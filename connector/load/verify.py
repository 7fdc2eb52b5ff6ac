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

if TYPE_CHECKING:
    from kvbridge.connector.base import BlockLoad
    from kvbridge.proto.layout import KVLayout
    from kvbridge.proto.types import BlockId

__all__ = ["Checked", "Expected"]


class Checked(NamedTuple):
    """What one group's check found."""

    good: int
    """Leading blocks whose digests match (the engine may use these)."""
    mismatches: int
    """Blocks whose digests differ (or have no digest to compare with)."""


@dataclass(frozen=True, slots=True)
class Expected:
    """The digests one load's blocks must have, under the hand-over's key."""

    key: int
    digests: Mapping[str, Sequence[bytes]]

    @classmethod
    def of(cls, load: BlockLoad) -> Expected | None:
        """The load's digests; None when it is not verified."""
        return None if load.digest_key is None else cls(load.digest_key, load.digests)

    def check(self, layout: KVLayout, group: str, ids: Sequence[BlockId]) -> Checked:
        """Digest blocks ``ids`` of bound ``layout`` (where they landed) and compare them,
        in order, with this group's first ``len(ids)`` digests."""
        want = list(self.digests.get(group, ()))[: len(ids)]
        if len(want) != len(ids):  # fail closed: a block without a digest is not used
            return Checked(0, len(ids))
        got = block_digests(layout, group, list(ids), self.key)
        bad = [
            i
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            if not hmac.compare_digest(a, b)
        ]
        return Checked(bad[0] if bad else len(ids), len(bad))

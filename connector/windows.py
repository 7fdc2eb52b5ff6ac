"""A hybrid model's further attention groups: which of their blocks a hand-over covers.

vLLM's hybrid KV cache manager gives each attention kind its own KV cache group with its
own block table (e.g. Gemma-3: sliding-window and full-attention layers). kvbridge's
``self`` group is the full-attention one; each further group ``g<i>``
(:func:`kvbridge.proto.attention_group`) is an :class:`AttentionGroups` entry with its
sliding window in tokens (None: it attends to every token, like ``self``).

Prefill hands over, and decode loads, only the blocks of such a group that a request still
needs once its prompt is computed: for a window of ``W`` tokens, the blocks from the one
holding token ``num_tokens - W + 1`` on (vLLM's own rule: it frees the earlier ones, so
prefill and decode agree on it). Their names are the ``self`` names of the same positions,
tagged with the group (:func:`~kvbridge.connector.handover.group_name`); they travel in the
``kv_transfer_params`` (``block_ids[g]``, ``block_hashes[g]``), are leased, sealed, digested
and verified like ``self``'s, and a group not read whole makes the whole request recompute.
The engine's placeholder for a block it does not hold (vLLM's null block) is never handed
over or loaded into. Used by the planner (:mod:`kvbridge.connector.scheduler`) only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.handover import group_name
from kvbridge.connector.params import KVTransferParams
from kvbridge.proto.errors import WireError
from kvbridge.proto.types import BlockHash, BlockId

__all__ = ["AttentionGroups", "GroupLoad"]


@dataclass(slots=True)
class GroupLoad:
    """The further groups' part of one load, per group."""

    local: dict[str, tuple[BlockId, ...]] = field(default_factory=dict)
    remote: dict[str, tuple[BlockId, ...]] = field(default_factory=dict)
    hashes: dict[str, tuple[BlockHash, ...]] = field(default_factory=dict)
    digests: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    """Where each group's first loaded block sits in the owner's lease of the group."""


@dataclass(frozen=True, slots=True)
class AttentionGroups:
    """An engine's further attention groups and their windows (empty: not hybrid)."""

    block_size: int
    windows: Mapping[str, int | None] = field(default_factory=dict)
    null_block: BlockId | None = None
    """The id the engine puts where a group holds no block (vLLM: 0, its null block)."""

    def __bool__(self) -> bool:
        return bool(self.windows)

    def start(self, group: str, num_tokens: int) -> int:
        """The first block of ``group`` an engine keeps once ``num_tokens`` are computed."""
        window = self.windows.get(group)
        return max(0, num_tokens - window + 1) // self.block_size if window else 0

    def hand_over(
        self,
        ids: dict[str, list[BlockId]],
        hashes: dict[str, list[BlockHash]],
        names: Sequence[BlockHash],
        num_tokens: int,
    ) -> bool:
        """Prefill: put each group's blocks to lease and their names into ``ids`` and
        ``hashes`` (groups not known here are dropped from ``ids``), for a prompt of
        ``num_tokens`` whose blocks (a partial last one included) are named ``names``. False
        when a group lacks one of its blocks (no hand-over: decode recomputes)."""
        for g in [g for g in ids if g not in ("self", "cross") and g not in self.windows]:
            del ids[g]
        end = len(names)
        for g in self.windows:
            lo = self.start(g, num_tokens)
            group = ids.get(g, [])[lo:end]
            if len(group) != end - lo or self.null_block in group:
                return False
            ids[g], hashes[g] = group, [group_name(g, n) for n in names[lo:end]]
        return True

    def check(self, params: KVTransferParams, names: Sequence[BlockHash]) -> None:
        """Decode: WireError unless prefill handed over every group's blocks this engine
        needs, under this prompt's names (``names``: its blocks' names, tail included)."""
        for g in self.windows:
            ids = params.block_ids.get(g, ())
            lo = len(names) - len(ids)
            if not ids or lo > self.start(g, params.num_tokens):
                raise WireError(
                    f"prefill handed over {len(ids)} {g!r} blocks; decode's window needs "
                    f"{len(names) - self.start(g, params.num_tokens)}"
                )
            if params.block_hashes.get(g, ()) != tuple(group_name(g, n) for n in names[lo:]):
                raise WireError(f"prefill's {g!r} block names do not match this prompt")

    def plan_load(
        self,
        block_ids: Mapping[str, Sequence[BlockId]],
        params: KVTransferParams,
        names: Sequence[BlockHash],
        first: int,
        verify: bool,
    ) -> GroupLoad:
        """Decode: each group's blocks from ``first`` (the local prefix hit) or its window
        start on, skipping the engine's null blocks, checked by :meth:`check` before."""
        out = GroupLoad()
        end = len(names)
        for g in self.windows:
            theirs = params.block_ids[g]
            lo = end - len(theirs)
            mine = list(block_ids.get(g, ()))
            start = max(first, lo)
            while start < end and start < len(mine) and mine[start] == self.null_block:
                start += 1  # the engine keeps no block there: it does not attend to it
            if start >= end:
                continue
            # a prefill window starting later than the blocks decode keeps cannot fill them:
            # the names then differ from the lease's and the load fails closed (recompute)
            offset = max(0, start - lo)
            out.local[g] = tuple(mine[start:end])
            out.remote[g] = theirs[offset:]
            out.hashes[g] = tuple(group_name(g, n) for n in names[start:end])
            out.offsets[g] = offset
            if verify:
                out.digests[g] = params.digests.get(g, ())[offset:]
        return out

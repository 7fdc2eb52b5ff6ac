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
over or loaded into. Used by the planner (:mod:`kvbridge.connector.planner`) only.

**Offload.** The CPU offload daemon keys a block by its name, so a group's block is stored
under its group name too (never confused with the ``self`` block of the same position).
A store takes each group's non-null full blocks (:meth:`AttentionGroups.store`); a prefix
hit of ``P`` blocks needs every ``self`` block before ``P`` and each group's blocks of the
window at ``P`` tokens (:meth:`AttentionGroups.offload_hit`: the longest ``P`` all groups
can serve, like vLLM's own ``HybridKVCacheCoordinator.find_longest_cache_hit``). A decode
with a remote prefill takes from the daemon each group's blocks it holds of the window the
decode keeps, before the end of the daemon's ``self`` hit (:meth:`AttentionGroups.decode_hits`,
:meth:`AttentionGroups.daemon_share`), and the rest from the prefill.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.handover import group_name
from kvbridge.connector.params import KVTransferParams
from kvbridge.proto.errors import ConfigError, WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.specs import is_attention_group
from kvbridge.proto.types import BlockHash, BlockId

__all__ = ["MAX_GROUP_LOOKUPS", "AttentionGroups", "Groups", "block_ratios"]

MAX_GROUP_LOOKUPS = 8
"""Lookups one offload plan may ask the daemon for the attention groups' blocks (each miss
inside a window lowers the candidate prefix to the missing block); past it: no hit."""


def block_ratios(block_size: int, block_sizes: Mapping[KVGroup, int]) -> dict[KVGroup, int]:
    """Each further group's block size in tokens (``block_sizes``) over ``self``'s
    (``block_size``), for :class:`AttentionGroups` ``ratios``: only the groups where it is
    not 1. ConfigError, naming the group, for a block size that is no whole multiple of
    ``self``'s (kvbridge names a group's block after the ``self`` blocks it covers)."""
    out: dict[KVGroup, int] = {}
    for g, size in block_sizes.items():
        if g == KVGroup.SELF or size == block_size:
            continue
        if size < block_size or size % block_size:
            raise ConfigError(
                f"KV cache group {g!r} has {size}-token blocks, which is not a whole multiple "
                f"of the {block_size}-token blocks of kvbridge's 'self' group (the first "
                "full-attention group): kvbridge moves a group only if each of its blocks "
                "covers whole 'self' blocks; start the model without --kv-transfer-config"
            )
        out[g] = size // block_size
    return out


@dataclass(frozen=True, slots=True)
class AttentionGroups:
    """An engine's further attention groups and their windows (empty: not hybrid)."""

    block_size: int
    windows: Mapping[KVGroup, int | None] = field(default_factory=dict)
    null_block: BlockId | None = None
    """The id the engine puts where a group holds no block (vLLM: 0, its null block)."""
    ratios: Mapping[KVGroup, int] = field(default_factory=dict)
    """A group's block size over ``self``'s where it is not 1 (:func:`block_ratios`)."""

    def __post_init__(self) -> None:
        for g, r in self.ratios.items():
            if g not in self.windows or not isinstance(r, int) or r < 1:
                raise ConfigError(
                    f"AttentionGroups.ratios: {g!r} -> {r!r}; give an integer >= 1 for a "
                    "group of windows only"
                )

    def __bool__(self) -> bool:
        return bool(self.windows)

    def ratio(self, group: KVGroup) -> int:
        """How many ``self`` blocks one block of ``group`` covers."""
        return self.ratios.get(group, 1)

    @property
    def lcm(self) -> int:
        """The ``self`` blocks of the shortest prefix that ends on a block boundary of every
        group (vLLM's ``scheduler_block_size`` over ``self``'s block size)."""
        return math.lcm(1, *self.ratios.values())

    def start(self, group: KVGroup, num_tokens: int) -> int:
        """The first block of ``group`` an engine keeps once ``num_tokens`` are computed."""
        window = self.windows.get(group)
        size = self.block_size * self.ratio(group)
        return max(0, num_tokens - window + 1) // size if window else 0

    def count(self, group: KVGroup, blocks: int) -> int:
        """How many blocks of ``group`` hold the tokens of ``blocks`` ``self`` blocks (the
        last one partial where ``blocks`` is no multiple of its ratio)."""
        return -(-blocks // self.ratio(group))

    def names(
        self, group: KVGroup, names: Sequence[BlockHash], lo: int = 0, stop: int | None = None
    ) -> tuple[BlockHash, ...]:
        """The names of ``group``'s blocks ``lo`` to ``stop`` (default: its last) over the
        tokens of the ``self`` blocks named ``names`` (a partial tail included): block ``j``
        is :func:`group_name` of the last of ``names`` it covers."""
        r, last = self.ratio(group), len(names) - 1
        stop = self.count(group, len(names)) if stop is None else stop
        return tuple(group_name(group, names[min(j * r + r - 1, last)]) for j in range(lo, stop))

    def hand_over(
        self,
        ids: dict[KVGroup, list[BlockId]],
        hashes: dict[KVGroup, list[BlockHash]],
        names: Sequence[BlockHash],
        num_tokens: int,
    ) -> bool:
        """Prefill: put each group's blocks to lease and their names into ``ids`` and
        ``hashes`` (groups not known here are dropped from ``ids``), for a prompt of
        ``num_tokens`` whose blocks (a partial last one included) are named ``names``. False
        when a group lacks one of its blocks (no hand-over: decode recomputes)."""
        for g in [g for g in ids if is_attention_group(g) and g not in self.windows]:
            del ids[g]
        for g in self.windows:
            lo, end = self.start(g, num_tokens), self.count(g, len(names))
            group = ids.get(g, [])[lo:end]
            if len(group) != end - lo or self.null_block in group:
                return False
            ids[g], hashes[g] = group, list(self.names(g, names, lo, end))
        return True

    def check(self, params: KVTransferParams, names: Sequence[BlockHash]) -> None:
        """Decode: WireError unless prefill handed over every group's blocks this engine
        needs, under this prompt's names (``names``: its blocks' names, tail included)."""
        for g in self.windows:
            ids = params.block_ids.get(g, ())
            end = self.count(g, len(names))
            lo = end - len(ids)
            if lo < 0:  # more than the prompt has (only where a block covers several)
                raise WireError(
                    f"prefill handed over {len(ids)} {g!r} blocks; the prompt has {end}"
                )
            if not ids or lo > self.start(g, params.num_tokens):
                raise WireError(
                    f"prefill handed over {len(ids)} {g!r} blocks; decode's window needs "
                    f"{end - self.start(g, params.num_tokens)}"
                )
            if params.block_hashes.get(g, ()) != self.names(g, names, lo, end):
                raise WireError(f"prefill's {g!r} block names do not match this prompt")

    def plan_load(
        self,
        block_ids: Mapping[KVGroup, Sequence[BlockId]],
        params: KVTransferParams,
        names: Sequence[BlockHash],
        first: int,
        into: tuple[_Ids, _Ids, _Names, dict[KVGroup, tuple[bytes, ...]] | None],
    ) -> dict[KVGroup, int]:
        """Decode: put each group's local and remote ids, names and (``into[3]`` not None)
        digests into ``into``: its blocks from ``first`` (the local prefix hit) or its window
        start on, skipping the engine's null blocks (checked by :meth:`check` before).
        Returns where each group's first loaded block sits in the owner's lease. Positions
        are the group's own (``first`` counts ``self`` blocks)."""
        local, remote, hashes, digests = into
        offsets = {}
        for g in self.windows:
            theirs = params.block_ids[g]
            end = self.count(g, len(names))
            lo = end - len(theirs)
            mine = list(block_ids.get(g, ()))
            start = max(first // self.ratio(g), lo)
            while start < end and start < len(mine) and mine[start] == self.null_block:
                start += 1  # the engine keeps no block there: it does not attend to it
            if start >= end:
                continue
            # a prefill window starting later than the blocks decode keeps cannot fill them:
            # the names then differ from the lease's and the load fails closed (recompute)
            offsets[g] = offset = max(0, start - lo)
            local[g] = tuple(mine[start:end])
            remote[g] = theirs[offset:]
            hashes[g] = self.names(g, names, start, end)
            if digests is not None:
                digests[g] = params.digests.get(g, ())[offset:]
        return offsets

    def store(
        self,
        block_ids: Mapping[KVGroup, Sequence[BlockId]],
        names: Sequence[BlockHash],
    ) -> tuple[list[BlockId], list[BlockHash]]:
        """Offload: each group's full blocks over the ``self`` blocks ``names`` name (the
        ``self`` blocks stored), under the group's names; never the engine's null block
        (a window's dropped positions)."""
        ids: list[BlockId] = []
        hashes: list[BlockHash] = []
        for g in self.windows:
            mine = block_ids.get(g, ())
            full = min(len(mine), len(names) // self.ratio(g))
            for pos, name in enumerate(self.names(g, names, 0, full)):
                if mine[pos] != self.null_block:
                    ids.append(mine[pos])
                    hashes.append(name)
        return ids, hashes

    def offload_hit(
        self,
        names: Sequence[BlockHash],
        first: int,
        hits: int,
        lookup: Callable[[Sequence[BlockHash]], int],
    ) -> int:
        """Offload: the longest prefix ``P`` (in blocks, ``first < P <= first + hits``) that
        every group can serve from the daemon, or ``first`` (no hit). ``names``: the
        prompt's full-block names; ``first``: the engine's own prefix hit (it holds each
        group's blocks of the window before it); ``hits``: the daemon's leading ``self``
        blocks from ``first``; ``lookup``: the daemon's leading hits of a list of names.
        A group's blocks of the window at ``P`` tokens must all be in the daemon; a missing
        one at position ``m`` rules out every ``P > m`` (their windows reach back to it),
        so the next candidate is ``m``. At most :data:`MAX_GROUP_LOOKUPS` lookups. ``P`` is
        a multiple of :attr:`lcm` (no group gets part of a block)."""
        step = self.lcm
        p = (first + hits) // step * step
        asked = 0
        while p > first:
            for g in self.windows:
                r = self.ratio(g)
                lo = max(first // r, self.start(g, p * self.block_size))
                want = self.names(g, names, lo, p // r)
                if asked == MAX_GROUP_LOOKUPS:
                    return first
                asked += 1
                got = max(0, min(len(want), lookup(want)))
                if got < len(want):
                    p = (lo + got) * r // step * step
                    break
            else:
                return p
        return first

    def offload_load(
        self,
        block_ids: Mapping[KVGroup, Sequence[BlockId]],
        names: Sequence[BlockHash],
        first: int,
        end: int,
    ) -> tuple[_Ids, _Names]:
        """Offload: each group's local blocks to load for a hit of ``end`` blocks after the
        engine's own ``first``, and their names: the window at ``end`` blocks' tokens, from
        ``first`` on, without the engine's null blocks (it attends to none there). ``end``
        is a multiple of every group's ratio (:meth:`offload_hit`)."""
        ids: _Ids = {}
        hashes: _Names = {}
        for g in self.windows:
            mine, r = block_ids.get(g, ()), self.ratio(g)
            lo = max(first // r, self.start(g, end * self.block_size))
            stop = min(end // r, len(mine))
            named = self.names(g, names, lo, max(lo, stop))
            pos = [p for p in range(lo, stop) if mine[p] != self.null_block]
            if pos:
                ids[g] = tuple(mine[p] for p in pos)
                hashes[g] = tuple(named[p - lo] for p in pos)
        return ids, hashes

    def decode_hits(
        self,
        names: Sequence[BlockHash],
        first: int,
        end: int,
        num_tokens: int,
        lookup: Callable[[Sequence[BlockHash]], int],
    ) -> dict[KVGroup, tuple[int, int]]:
        """Offload, for a decode with a remote prefill whose ``self`` blocks ``first`` to
        ``end`` the daemon serves (``names``: the prompt's full-block names): per group,
        the positions ``(lo, stop)`` of its blocks the daemon holds too, a leading run from
        its window start at ``num_tokens`` (or ``first``) on, before ``end``. The daemon
        serves a sliding group's blocks only where they are the window the decode keeps;
        prefill hands over the rest. One lookup per group. Positions are the group's own:
        its full blocks before ``end``."""
        spans = {}
        for g in self.windows:
            r = self.ratio(g)
            lo = max(first // r, self.start(g, num_tokens))
            want = self.names(g, names, lo, max(lo, end // r))
            got = max(0, min(len(want), lookup(want))) if want else 0
            if got:
                spans[g] = (lo, lo + got)
        return spans

    def daemon_share(
        self,
        plan: tuple[_Ids, _Names],
        params: KVTransferParams,
        offsets: Mapping[KVGroup, int],
        end: int,
        spans: Mapping[KVGroup, tuple[int, int]],
    ) -> _Names:
        """Decode with a remote prefill: per group, the daemon's names of the leading blocks
        of its load (``plan``: the local ids and names :meth:`plan_load` put in, ``offsets``
        what it returned; ``end``: the prompt's block count) that :meth:`decode_hits` found
        (``spans``); none where the load starts before the daemon's run."""
        local, hashes = plan
        share: _Names = {}
        for g, (lo, stop) in spans.items():
            if g not in local:
                continue
            # the load's first position, in the group's blocks
            start = self.count(g, end) - len(params.block_ids[g]) + offsets[g]
            n = min(stop, start + len(local[g])) - start
            if lo <= start and n > 0:
                share[g] = tuple(hashes[g][:n])
        return share

    @staticmethod
    def names_of(params: KVTransferParams) -> dict[KVGroup, tuple[BlockHash, ...]]:
        """The attention groups' names in ``params`` (what the owner's lease seals)."""
        return {g: h for g, h in params.block_hashes.items() if is_attention_group(g)}


Groups = AttentionGroups | None
"""The planner's argument: an engine's attention groups, or None (not hybrid)."""
_Ids = dict[KVGroup, tuple[BlockId, ...]]
_Names = dict[KVGroup, tuple[BlockHash, ...]]

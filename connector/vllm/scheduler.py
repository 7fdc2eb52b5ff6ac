"""vLLM's scheduler calls, translated for the one planner.

Runs in vLLM's scheduler (the EngineCore process). Every decision (which blocks
load from where, what prefill hands over, what is stored) is made by
:class:`~kvbridge.connector.planner.KVBridgePlanner`, the same planner
kvbridge's reference engine uses; this module only translates. It imports no
vLLM: the adapter (:mod:`kvbridge.connector.vllm.connector`) unpacks vLLM's
objects into plain values. What differs in vLLM:

- the KV memory lives in the worker processes, so a finished prefill request's
  blocks are held by vLLM's ``delay_free``: the planner's lease issuer here
  (:class:`HoldIssuer`) orders a :class:`HoldOrder` that the worker turns into a
  lease; vLLM frees the blocks when the worker reports the request in
  ``get_finished(done_sending)`` (also once an offload store is over);
- ``kv_transfer_params`` travel through vLLM's JSON API, so block hashes are
  hex strings on that side (:func:`to_json_params` / :func:`from_json_params`);
- block names are kvbridge's own (:class:`~kvbridge.proto.hashing.BlockHasher`
  over the prompt's full blocks, computed only when the planner asks for
  them), not vLLM's ``request.block_hashes``: see ``docs/VLLM.md`` ("Hashing");
- a finished request is named over every token whose KV it computed, its
  generated tokens included, so the offload store takes the full blocks decode
  completed too (a hand-over still names the prompt's blocks only: the names are
  one chain, so the prompt's are a prefix of them).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvbridge.connector.base import RequestView, StepMetadata
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.leases import GroupBlocks, GroupHashes
from kvbridge.connector.planner import KVBridgePlanner, LeaseIssuer
from kvbridge.connector.windows import AttentionGroups, block_ratios
from kvbridge.proto.errors import KVBridgeError
from kvbridge.proto.hashing import BlockHasher
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = [
    "HoldIssuer",
    "HoldOrder",
    "VllmScheduler",
    "from_json_params",
    "kv_tokens",
    "to_json_params",
]

log = logging.getLogger(__name__)

_HASH_KEY = "block_hashes"

VLLM_NULL_BLOCK = BlockId(0)
"""vLLM's null block: the id its block tables hold where a group keeps no block (a sliding
window's blocks that fell out of it). Never handed over, never loaded into."""


@dataclass(frozen=True, slots=True)
class HoldOrder:
    """Scheduler → worker: keep ``request_id``'s blocks under ``lease_id`` for a decode peer.

    vLLM already holds the blocks (``delay_free``); the worker puts them under
    a lease in its control server and reports the request in ``done_sending``
    once the lease is released or expires.
    """

    request_id: RequestId
    lease_id: LeaseId
    block_ids: tuple[BlockId, ...]
    block_hashes: tuple[BlockHash, ...]
    ttl_s: float
    digest_key: int | None = None
    """The hand-over's digest key (the scheduler drew it; it goes to the decode only in the
    kv_transfer_params): the worker digests the blocks under it when it makes the lease."""
    group_blocks: Mapping[KVGroup, tuple[BlockId, ...]] = field(default_factory=dict)
    """A hybrid model's further attention groups (``g<i>``): the blocks held with ``self``'s
    (those a decode attends to), leased, sealed and digested with them."""
    group_hashes: Mapping[KVGroup, tuple[BlockHash, ...]] = field(default_factory=dict)
    """The names of ``group_blocks``."""

    def blocks(self) -> dict[KVGroup, tuple[BlockId, ...]]:
        """Every group's held blocks, ``self`` first."""
        return {KVGroup.SELF: self.block_ids, **self.group_blocks}

    def hashes(self) -> dict[KVGroup, tuple[BlockHash, ...]]:
        return {KVGroup.SELF: self.block_hashes, **self.group_hashes}


def to_json_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``kv_transfer_params`` (``KVTransferParams.to_dict()``) as vLLM's OpenAI API can carry
    them: hashes (and block digests) as hex strings."""
    out = dict(params)
    for key in (_HASH_KEY, "digests"):
        if key in params:
            out[key] = {g: [bytes(h).hex() for h in hs] for g, hs in params[key].items()}
    return out


def _unhex(value: Any) -> Any:
    try:
        return bytes.fromhex(value) if isinstance(value, str) else value
    except ValueError:
        return value  # KVTransferParams.parse rejects it with a WireError


def from_json_params(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The inverse of :func:`to_json_params`. It never raises: what it cannot convert stays
    as it was, for :meth:`KVTransferParams.parse` to reject with a clear reason."""
    if raw is None:
        return None
    out = dict(raw)
    for key in (_HASH_KEY, "digests"):
        hashes = raw.get(key)
        if isinstance(hashes, Mapping):
            out[key] = {
                g: [_unhex(h) for h in hs] if isinstance(hs, (list, tuple)) else hs
                for g, hs in hashes.items()
            }
    return out


def kv_tokens(all_tokens: Sequence[int], num_computed: int) -> list[int]:
    """The tokens whose KV a finished request's blocks hold: its prompt and every generated
    token but the last (sampled, never fed back), or fewer if vLLM computed fewer."""
    return list(all_tokens[: max(0, min(num_computed, len(all_tokens) - 1))])


class HoldIssuer(LeaseIssuer):
    """The planner's lease issuer inside vLLM: a lease is an order to the worker.

    vLLM keeps the blocks (``delay_free``); the worker puts them under the lease
    named here when the step's metadata arrives. Every block vLLM hands over was
    computed for this request's prompt (the planner hands over only requests whose
    prompt was computed), so the whole named prefix is verified.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._orders: list[HoldOrder] = []

    def verified_prefix(
        self, group: KVGroup, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> int:
        return min(len(block_ids), len(hashes)) if group == KVGroup.SELF else 0

    def lease_request(
        self, request_id: RequestId, blocks: GroupBlocks, hashes: GroupHashes
    ) -> tuple[LeaseId, float]:
        lease_id = LeaseId(secrets.token_hex(16))
        others = [g for g in blocks if g != KVGroup.SELF]
        order = HoldOrder(
            request_id,
            lease_id,
            tuple(blocks[KVGroup.SELF]),
            tuple(hashes.get(KVGroup.SELF, ())),
            self.ttl_s,
            group_blocks={g: tuple(blocks[g]) for g in others},
            group_hashes={g: tuple(hashes.get(g, ())) for g in others},
        )
        self._orders.append(order)
        return lease_id, self.ttl_s

    digests_at_owner = True

    def digests(self, blocks: GroupBlocks, key: int) -> dict[KVGroup, list[bytes]] | None:
        """Send ``key`` with the request's hold order: the worker, where the KV lives, digests
        the held blocks when it makes the lease (called right after :meth:`lease_request`)."""
        if not self._orders or tuple(blocks.get(KVGroup.SELF, ())) != self._orders[-1].block_ids:
            return None
        self._orders[-1] = replace(self._orders[-1], digest_key=key)
        return {}

    def ordered(self, request_id: RequestId) -> bool:
        """Whether a hold for ``request_id`` waits to go to the worker."""
        return any(o.request_id == request_id for o in self._orders)

    def take(self) -> tuple[HoldOrder, ...]:
        orders, self._orders = tuple(self._orders), []
        return orders


class _PromptNames(Mapping[KVGroup, Sequence[BlockHash]]):
    """``RequestView.block_hashes`` for a vLLM request: the full-block names of ``tokens``
    (the prompt, or at the end every token with computed KV), hashed on first use only
    (most requests are never asked for them)."""

    def __init__(self, hasher: BlockHasher, tokens: Sequence[int]) -> None:
        self._hasher = hasher
        self._prompt = tokens
        self._names: tuple[BlockHash, ...] | None = None

    def __getitem__(self, group: KVGroup) -> Sequence[BlockHash]:
        if group != KVGroup.SELF:
            raise KeyError(group)
        if self._names is None:
            self._names = tuple(self._hasher.hash_blocks(list(self._prompt)))
        return self._names

    def __iter__(self) -> Iterator[KVGroup]:
        return iter((KVGroup.SELF,))

    def __len__(self) -> int:
        return 1


class VllmScheduler:
    """vLLM's scheduler-side connector calls, each translated into the planner's."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        hasher: BlockHasher,
        offload_lookup: Callable[[Sequence[BlockHash]], int] | None = None,
        tp_size: int = 1,
        groups: Sequence[KVGroup] = (KVGroup.SELF,),
        windows: Mapping[KVGroup, int | None] | None = None,
        block_sizes: Mapping[KVGroup, int] | None = None,
    ) -> None:
        """``block_sizes``: each group's block size in tokens where it is not
        ``block_size`` (``self``'s); ConfigError where it is no whole multiple of it."""
        self.hasher = hasher
        self.groups = tuple(groups)
        """kvbridge's name of each of vLLM's KV cache groups, by vLLM's group index."""
        self.holds = HoldIssuer(config.lease_ttl_s)
        ratios = block_ratios(block_size, block_sizes or {})
        attention = AttentionGroups(block_size, dict(windows or {}), VLLM_NULL_BLOCK, ratios)
        self.planner = KVBridgePlanner(config, block_size, tp_size, attention)
        self.planner.attach(self.holds, offload_lookup)

    @property
    def offload_lookup(self) -> Callable[[Sequence[BlockHash]], int] | None:
        """With an offload daemon: how many leading blocks of a prefix it holds."""
        return self.planner.offload_lookup

    @offload_lookup.setter
    def offload_lookup(self, lookup: Callable[[Sequence[BlockHash]], int] | None) -> None:
        self.planner.offload_lookup = lookup

    def _view(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        raw_params: Mapping[str, Any] | None,
        prompt_computed: bool = True,
        named: Sequence[int] | None = None,
    ) -> RequestView:
        """``named``: the tokens whose full blocks are named (default: the prompt)."""
        return RequestView(
            request_id=request_id,
            prompt_token_ids=prompt,
            block_hashes=_PromptNames(self.hasher, prompt if named is None else named),
            kv_transfer_params=from_json_params(raw_params),
            prompt_computed=prompt_computed,
        )

    def num_matched(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        raw_params: Mapping[str, Any] | None,
        num_computed_tokens: int,
    ) -> tuple[int, bool]:
        """Tokens to load beyond the local prefix hit (``get_num_new_matched_tokens``)."""
        view = self._view(request_id, prompt, raw_params)
        return self.planner.get_num_new_matched_tokens(view, num_computed_tokens)

    def by_group(
        self, block_ids: Sequence[Sequence[int]] | Sequence[int]
    ) -> dict[KVGroup, list[BlockId]]:
        """vLLM's block ids per KV cache group (a tuple by group index; one group's list
        alone for a model with one group) by kvbridge's group names."""
        groups: list[Sequence[int]] = (
            [block_ids]  # type: ignore[list-item]
            if not block_ids or isinstance(block_ids[0], int)
            else list(block_ids)  # type: ignore[arg-type]
        )
        if len(groups) != len(self.groups):
            raise KVBridgeError(
                f"vLLM passed block ids of {len(groups)} KV cache groups, kvbridge was "
                f"started with {len(self.groups)}"
            )
        return {g: [BlockId(b) for b in ids] for g, ids in zip(self.groups, groups, strict=True)}

    def after_alloc(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        block_ids: Sequence[Sequence[int]] | Sequence[int],
        num_external_tokens: int,
    ) -> None:
        """vLLM allocated ``block_ids`` (the request's whole block table per KV cache group).
        The plan was made in :meth:`num_matched`; the load's names and seal are computed here
        from ``prompt``."""
        view = self._view(request_id, prompt, None)
        self.planner.update_state_after_alloc(view, self.by_group(block_ids), num_external_tokens)

    def build_step(self) -> tuple[StepMetadata, tuple[HoldOrder, ...]]:
        """This step's loads, offload stores and hold orders; resets them."""
        return self.planner.build_connector_meta(), self.holds.take()

    def request_finished(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        raw_params: Mapping[str, Any] | None,
        block_ids: Sequence[Sequence[int]] | Sequence[int],
        prompt_done: bool,
        computed: Sequence[int] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a finished or aborted request (its block
        ids per KV cache group); ``prompt_done``: it finished normally with its whole prompt
        computed; ``computed``: the tokens whose KV its blocks hold, the prompt followed by
        generated tokens (default: the prompt). Their full blocks are what an offload store
        takes."""
        n = len(prompt)
        if computed is not None and (len(computed) < n or list(computed[:n]) != list(prompt)):
            log.warning("request %s: its computed tokens do not extend its prompt", request_id)
            computed = None
        view = self._view(request_id, prompt, raw_params, prompt_done, computed)
        delay_free, params = self.planner.request_finished(view, self.by_group(block_ids))
        # a request put under a hold must keep its blocks until the worker reports the
        # lease over (done_sending): vLLM frees them at once otherwise
        delay_free = delay_free or self.holds.ordered(request_id)
        return delay_free, None if params is None else to_json_params(params)

"""The one planner: which blocks a request loads, what a prefill hands over, what is stored.

Both engines use :class:`KVBridgePlanner`: kvbridge's reference engine calls
it directly (it is that engine's :class:`SchedulerConnector`), and vLLM's
adapter (:mod:`kvbridge.connector.vllm.scheduler`) translates vLLM's calls
into :class:`RequestView` s and calls the same methods. Runs in the engine's
scheduler thread (vLLM: the EngineCore process); nothing here touches memory.

*Decode* (``kv_transfer_params`` came from a prefill worker): the request's
prompt is the original prompt (vLLM's proxies) or the original prompt plus the
first token prefill sampled (kvbridge's router). The engine has already taken
its own prefix-cache hits; every original-prompt token after them is external.
Before offering anything, the hashes prefill sent are compared with the hashes
of the prompt this engine was given: a router that pairs the wrong prompt with
the wrong KV gets a recompute, never wrong tokens. With an offload daemon, the
leading blocks it holds (after the local hit) load from there, the rest from
prefill. A request whose load was planned once is never offered a second try
(after a failed load the engine asks again; the answer is then a recompute).

*Offload only* (no remote prefill): the daemon's leading hits after the local
prefix load from the daemon; the last prompt token is always left to compute.

*Cross-attention blocks* (encoder-decoder) travel with the self blocks: prefill
leases both groups and lists both in its answer; decode loads the ``cross``
blocks only when the engine names them in ``update_state_after_alloc`` (it
does not when its own cache already holds that encoder input's blocks) and
prefill's cross hashes equal the request's.

*Hybrid models*: each further attention group's blocks travel with the ``self`` blocks (to
a decode, to and from the offload daemon: a decode takes what it holds of each group), a
sliding window's in-window ones only (``windows``).

*Prefill* (``do_remote_decode``): when a request whose prompt was computed
finishes, its blocks are put under a lease by a :class:`LeaseIssuer` (the
reference engine pins them itself; vLLM's adapter orders its worker to hold
them) and the answer tells decode where they are.

*Store*: a finished request's full blocks that the engine itself holds under
exactly the expected names go to the offload daemon; the engine then keeps them
(``delay_free``) until the worker reports the store done.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvbridge.connector.base import (
    BlockLoad,
    BlockStore,
    RequestView,
    SchedulerConnector,
    StepMetadata,
)
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.handover import LeaseIssuer, tail_name
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.prompt_names import load_cross, load_seal, prompt_names
from kvbridge.connector.windows import AttentionGroups, Groups
from kvbridge.kernels.digest import new_key
from kvbridge.proto.errors import KVBridgeError, WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, RequestId

__all__ = ["KVBridgePlanner", "LeaseIssuer", "tail_name"]

log = logging.getLogger(__name__)

MAX_REFUSALS = 4096
"""Refused loads remembered for the stats (engines that never ask for them forget)."""


@dataclass(slots=True)
class _Pending:
    params: KVTransferParams | None
    """Prefill's answer; None for a load from the offload daemon alone."""
    first_block: int
    offload_hashes: tuple[BlockHash, ...] = ()
    """Names of the blocks from ``first_block`` on that the offload daemon holds."""
    names: tuple[BlockHash, ...] = ()  # offload only: the prompt's names (a hybrid's groups)
    spans: Mapping[KVGroup, tuple[int, int]] | None = None  # decode: groups' daemon blocks


class KVBridgePlanner(SchedulerConnector):
    """The scheduler half of every engine kvbridge runs in (see the module docstring)."""

    def __init__(
        self, config: ConnectorConfig, block_size: int, tp_size: int = 1, groups: Groups = None
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.groups = groups or AttentionGroups(block_size)
        """A hybrid model's further attention groups (``g<i>``) and their windows."""
        self.tp_size = tp_size
        """The engine's tensor-parallel size: a prefill whose size divides it or is a
        multiple of it is loaded by head slices (heterogeneous TP); any other size
        recomputes."""
        self.issuer: LeaseIssuer | None = None
        self.offload_lookup: Callable[[Sequence[BlockHash]], int] | None = None
        self._stores: list[BlockStore] = []
        self._pending: dict[RequestId, _Pending] = {}
        self._loads: list[BlockLoad] = []
        self._loaded: set[RequestId] = set()
        """Requests whose load was planned: asked again after a failed load, the answer is
        0 (recompute), never a second try at the same lease."""
        self.refused: OrderedDict[RequestId, tuple[str, int]] = OrderedDict()
        """Why a request's remote KV was not loaded and how many of its blocks it
        recomputes for that, for its stats (the node pops them; the oldest go past
        :data:`MAX_REFUSALS`)."""

    def attach(
        self,
        issuer: LeaseIssuer,
        offload_lookup: Callable[[Sequence[BlockHash]], int] | None = None,
    ) -> None:
        """Wire what exists only once the engine does: the lease issuer (prefill side) and,
        with an offload daemon, the lookup of how many leading blocks it holds."""
        self.issuer = issuer
        self.offload_lookup = offload_lookup

    # ----- decode --------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if request.request_id in self._loaded:
            return 0, False
        raw = request.kv_transfer_params
        first = num_computed_tokens // self.block_size
        if not self.config.consumes or not KVTransferParams.is_remote_prefill(raw):
            return self._offload_hits(request, first)
        assert raw is not None
        try:
            params = KVTransferParams.parse(raw, self.block_size)
            self._check_matches_prompt(request, params)
        except WireError as exc:
            return self._refuse(request, num_computed_tokens, str(exc))
        small, big = sorted((params.tp_size, self.tp_size))
        if small < 1 or big % small:
            why = (
                f"prefill TP={params.tp_size}, decode TP={self.tp_size}: neither TP size "
                "divides the other"
            )
            return self._refuse(request, num_computed_tokens, why)
        external = params.num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        # blocks the node's offload daemon holds come from there (every group's, a sliding
        # group's where they are its window); the rest from prefill
        full = len(params.block_hashes[KVGroup.SELF])  # prefill's full blocks
        names = tuple(request.block_hashes.get(KVGroup.SELF, ())[:full])
        k = self._lookup(names[first:])
        spans = self.groups.decode_hits(names, first, first + k, params.num_tokens, self._lookup)
        self._pending[request.request_id] = _Pending(params, first, names[first:][:k], (), spans)
        return external, True

    def _refuse(self, request: RequestView, computed: int, why: str) -> tuple[int, bool]:
        """Recompute instead of loading prefill's KV: logged, and kept for the stats."""
        log.warning("request %s: not loading remote KV (%s); recomputing", request.request_id, why)
        blocks = -(-(len(request.prompt_token_ids) - computed) // self.block_size)
        self.refused[request.request_id] = (f"not loaded: {why}", max(0, blocks))
        while len(self.refused) > MAX_REFUSALS:
            self.refused.popitem(last=False)
        return 0, False

    def _offload_hits(self, request: RequestView, first: int) -> tuple[int, bool]:
        """Blocks after the local prefix that the offload daemon holds (no remote prefill)."""
        last = (len(request.prompt_token_ids) - 1) // self.block_size  # keep a token to compute
        if self.offload_lookup is None or last <= first:
            return 0, False  # (before naming the blocks: vLLM hashes its prompt on demand)
        names = tuple(request.block_hashes.get(KVGroup.SELF, ())[:last])
        hits = self._lookup(names[first:])
        if hits > 0 and self.groups:  # every group's window at the hit's end, or shorter
            hits = self.groups.offload_hit(names, first, hits, self._lookup) - first
        if hits <= 0:
            return 0, False
        hashes = names[first : first + hits]
        self._pending[request.request_id] = _Pending(None, first, hashes, names)
        return hits * self.block_size, True

    def _lookup(self, hashes: Sequence[BlockHash]) -> int:
        if self.offload_lookup is None or not hashes:
            return 0
        return max(0, min(len(hashes), self.offload_lookup(hashes)))

    def _check_matches_prompt(self, request: RequestView, params: KVTransferParams) -> None:
        n = len(request.prompt_token_ids)
        if n not in (params.num_tokens, params.num_tokens + 1):
            raise WireError(
                f"prefill computed {params.num_tokens} tokens, decode got a prompt of {n} "
                "(expected the same prompt, or prompt + first token)"
            )
        theirs = params.block_hashes[KVGroup.SELF]
        mine = tuple(request.block_hashes.get(KVGroup.SELF, ()))[: len(theirs)]
        if mine != theirs:
            raise WireError(
                "prefill's block hashes do not match this prompt (other tokens, or another "
                "hash seed/model on the prefill side?)"
            )
        if self.groups:
            self.groups.check(params, self._names(request, params.num_tokens))

    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: Mapping[KVGroup, Sequence[BlockId]],
        num_external_tokens: int,
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        self._loaded.add(request.request_id)
        first, offload_hashes = pending.first_block, pending.offload_hashes
        k = len(offload_hashes)
        params = pending.params
        if params is None:  # blocks from the offload daemon only
            ids, named = self.groups.offload_load(block_ids, pending.names, first, first + k)
            own = {KVGroup.SELF: tuple(block_ids[KVGroup.SELF][first : first + k]), **ids}
            load = BlockLoad(request.request_id, "", "", own, {}, offload_hashes=offload_hashes)
            self._loads.append(replace(load, offload_groups=named))
            return
        end = -(-params.num_tokens // self.block_size)
        local = {KVGroup.SELF: tuple(block_ids[KVGroup.SELF][first:end])}
        remote = {KVGroup.SELF: params.block_ids[KVGroup.SELF][first:end]}
        names = self._names(request, params.num_tokens)
        hashes = {KVGroup.SELF: names[first:]}
        verify = self.config.verify_loads and params.digest_key is not None
        digests = {KVGroup.SELF: params.digests.get(KVGroup.SELF, ())[first:end]} if verify else {}
        offsets = self.groups.plan_load(
            block_ids, params, names, first, (local, remote, hashes, digests if verify else None)
        )
        if load_cross(request, block_ids, params):
            local[KVGroup.CROSS] = tuple(block_ids[KVGroup.CROSS])
            remote[KVGroup.CROSS] = params.block_ids[KVGroup.CROSS]
            hashes[KVGroup.CROSS] = params.block_hashes[KVGroup.CROSS]
            if verify:
                digests[KVGroup.CROSS] = params.digests.get(KVGroup.CROSS, ())
        self._loads.append(
            BlockLoad(
                request_id=request.request_id,
                remote_engine=params.remote_engine_id,
                remote_address=params.remote_address,
                local_ids=local,
                remote_ids=remote,
                lease_id=params.lease_id,
                remote_hashes=hashes,
                offload_hashes=offload_hashes,
                offload_groups=self.groups.daemon_share(
                    (local, hashes), params, offsets, len(names), pending.spans or {}
                ),
                remote_request_id=params.request_id,
                first_block=first,
                seal=load_seal(request, params, names),
                remote_tp_size=params.tp_size,
                digest_key=params.digest_key if verify else None,
                digests=digests,
                digest_algo=params.digest_algo,
                digests_at_owner=verify and params.digests_at_owner,
                lease_offsets=offsets,
                whole_lease=params.leased_whole(remote),
            )
        )

    def _names(self, request: RequestView, num_tokens: int) -> tuple[BlockHash, ...]:
        return prompt_names(request, num_tokens, self.block_size)

    def build_connector_meta(self) -> StepMetadata:
        loads, self._loads = tuple(self._loads), []
        stores, self._stores = tuple(self._stores), []
        return StepMetadata(loads=loads, stores=stores)

    # ----- prefill -------------------------------------------------------------------------
    def request_finished(
        self, request: RequestView, block_ids: Mapping[KVGroup, Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        raw = request.kv_transfer_params
        hand_over = bool(self.config.produces and raw and raw.get("do_remote_decode"))
        if not request.prompt_computed:
            if hand_over:
                log.info(
                    "request %s ended before its prompt was computed; no hand-over",
                    request.request_id,
                )
            return False, None
        delay_free = self._store(request, block_ids)
        if not hand_over or self.issuer is None:
            return delay_free, None
        ids = {g: list(b) for g, b in block_ids.items() if b}
        num_tokens = len(request.prompt_token_ids)
        needed = -(-num_tokens // self.block_size)
        if len(ids.get(KVGroup.SELF, ())) < needed:
            log.warning("request %s: too few blocks; no hand-over", request.request_id)
            return delay_free, None
        ids[KVGroup.SELF] = ids[KVGroup.SELF][:needed]
        hashes = {
            KVGroup.SELF: list(request.block_hashes.get(KVGroup.SELF, ()))[
                : num_tokens // self.block_size
            ]
        }
        if not self.groups.hand_over(ids, hashes, self._names(request, num_tokens), num_tokens):
            log.warning("request %s: a KV cache group lacks blocks", request.request_id)
            return delay_free, None
        cross_hashes = list(request.block_hashes.get(KVGroup.CROSS, ()))
        if ids.get(KVGroup.CROSS) and len(ids[KVGroup.CROSS]) == len(cross_hashes):
            hashes[KVGroup.CROSS] = cross_hashes
        else:
            ids.pop(KVGroup.CROSS, None)
        leased = {**hashes, KVGroup.SELF: list(self._names(request, num_tokens))}
        try:
            lease_id, ttl_s = self.issuer.lease_request(request.request_id, ids, leased)
        except KVBridgeError as exc:
            log.warning("request %s: no lease (%s); decode recomputes", request.request_id, exc)
            return delay_free, None
        key, digests = self._digests(request.request_id, ids)
        params = KVTransferParams(
            remote_engine_id=self.config.engine_id,  # type: ignore[arg-type]
            remote_address=self.config.control_address,
            request_id=request.request_id,
            num_tokens=num_tokens,
            block_ids={g: tuple(v) for g, v in ids.items()},  # type: ignore[misc]
            block_hashes={g: tuple(v) for g, v in hashes.items()},
            lease_id=lease_id,
            lease_ttl_s=ttl_s,
            tp_size=self.tp_size,
            digest_key=key,
            digests={g: tuple(d) for g, d in digests.items()},
            digests_at_owner=key is not None and self.issuer.digests_at_owner,
            digest_algo=self.issuer.digest_algo(),
        )
        return delay_free, params.to_dict()

    def _digests(
        self, request_id: RequestId, ids: Mapping[KVGroup, Sequence[BlockId]]
    ) -> tuple[int | None, dict[KVGroup, list[bytes]]]:
        """A fresh key and the leased blocks' digests under it; ``(None, {})``: unverified."""
        key = new_key()
        try:
            digests = self.issuer.digests(ids, key) if self.config.verify_loads else None  # type: ignore[union-attr]
        except KVBridgeError as exc:  # e.g. memory the CPU digest cannot read
            log.warning("request %s: no block digests (%s)", request_id, exc)
            digests = None
        return (None, {}) if digests is None else (key, digests)

    def _store(self, request: RequestView, block_ids: Mapping[KVGroup, Sequence[BlockId]]) -> bool:
        """Queue the request's verified full blocks for the offload daemon; True if queued
        (the engine then keeps the blocks until the worker reports the store done)."""
        if self.offload_lookup is None or self.issuer is None:
            return False
        ids = list(block_ids.get(KVGroup.SELF, ()))
        hashes = list(request.block_hashes.get(KVGroup.SELF, ()))[: len(ids)]
        # only blocks the engine itself holds under exactly these names: never store
        # a block of an aborted request whose KV was not written whole
        n = self.issuer.verified_prefix(KVGroup.SELF, ids[: len(hashes)], hashes)
        if n <= 0:
            return False
        more, named = self.groups.store(block_ids, hashes[:n])  # a hybrid's other groups
        self._stores.append(
            BlockStore(request.request_id, (*ids[:n], *more), (*hashes[:n], *named))
        )
        return True

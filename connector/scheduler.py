"""kvbridge's scheduler half: which blocks a request loads, and what a prefill hands over.

Runs in the engine's scheduler thread (vLLM: the scheduler process).

*Decode* (``kv_transfer_params`` came from a prefill worker): the request's
prompt is the original prompt plus the first token prefill sampled. The
engine has already taken its own prefix-cache hits; every original-prompt
token after them is external and is loaded asynchronously from the prefill
worker's blocks at the same block positions. Before offering anything, the
hashes prefill sent are compared with the hashes of the prompt this engine
was given: a router that pairs the wrong prompt with the wrong KV gets a
recompute, never wrong tokens.

*Cross-attention blocks* (encoder-decoder) travel with the self blocks: prefill
leases both groups and lists both in its answer; decode loads the ``cross``
blocks only when the engine names them in ``update_state_after_alloc`` (it
does not when its own cache already holds that encoder input's blocks) and
prefill's cross hashes equal the request's. The engine runs the encoder
itself whenever a cross load is not planned or fails.

*Prefill* (``do_remote_decode``): when the request finishes, its blocks are
pinned under a lease (a :class:`LeaseIssuer` owns that) and the answer tells
decode where they are. The engine frees its own references at once; the
lease holds its own until decode releases it or it expires.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.base import (
    BlockLoad,
    BlockStore,
    RequestView,
    SchedulerConnector,
    StepMetadata,
)
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.params import KVTransferParams
from kvbridge.proto.errors import KVBridgeError, WireError
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = ["KVBridgeScheduler", "LeaseIssuer"]

log = logging.getLogger(__name__)


class LeaseIssuer(ABC):
    """Pins a finished prefill request's blocks under a lease that a decode peer releases.

    Implemented by the process that owns the KV memory and runs the control
    server (:class:`kvbridge.worker.serving.node.Node`); called from the scheduler thread.
    """

    @abstractmethod
    def verified_prefix(
        self, group: str, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> int:
        """How many leading ``block_ids`` hold exactly the KV named by ``hashes``."""

    @abstractmethod
    def lease_request(
        self,
        request_id: RequestId,
        blocks: Mapping[str, Sequence[BlockId]],
        hashes: Mapping[str, Sequence[BlockHash]],
    ) -> tuple[LeaseId, float]:
        """Take a reference on ``blocks`` and put it under a new lease: ``(lease_id, ttl_s)``."""


@dataclass(slots=True)
class _Pending:
    params: KVTransferParams | None
    first_block: int
    offload_blocks: int = 0


class KVBridgeScheduler(SchedulerConnector):
    """The scheduler half for kvbridge's own engines (and, through the adapter, vLLM)."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.issuer: LeaseIssuer | None = None
        self.offload_lookup: Callable[[Sequence[BlockHash]], int] | None = None
        self._stores: list[BlockStore] = []
        self._pending: dict[RequestId, _Pending] = {}
        self._loads: list[BlockLoad] = []

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
        raw = request.kv_transfer_params
        first = num_computed_tokens // self.block_size
        if not self.config.consumes or not KVTransferParams.is_remote_prefill(raw):
            return self._offload_hits(request, first)
        assert raw is not None
        try:
            params = KVTransferParams.parse(raw, self.block_size)
            self._check_matches_prompt(request, params)
        except WireError as exc:
            log.warning(
                "request %s: not loading remote KV (%s); recomputing", request.request_id, exc
            )
            return 0, False
        external = params.num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        # blocks the node's offload daemon holds come from there; the rest from prefill
        full = len(params.block_hashes["self"])
        offload = self._lookup(request.block_hashes.get("self", ())[first:full])
        self._pending[request.request_id] = _Pending(params, first, offload)
        return external, True

    def _offload_hits(self, request: RequestView, first: int) -> tuple[int, bool]:
        """Blocks after the local prefix that the offload daemon holds (no remote prefill)."""
        last = (len(request.prompt_token_ids) - 1) // self.block_size  # keep a token to compute
        n = self._lookup(request.block_hashes.get("self", ())[first:last])
        if n <= 0:
            return 0, False
        self._pending[request.request_id] = _Pending(None, first, n)
        return n * self.block_size, True

    def _lookup(self, hashes: Sequence[BlockHash]) -> int:
        if self.offload_lookup is None or not hashes:
            return 0
        return max(0, min(len(hashes), self.offload_lookup(hashes)))

    def _check_matches_prompt(self, request: RequestView, params: KVTransferParams) -> None:
        if len(request.prompt_token_ids) != params.num_tokens + 1:
            raise WireError(
                f"prefill computed {params.num_tokens} tokens, decode got a prompt of "
                f"{len(request.prompt_token_ids)} (expected prompt + first token)"
            )
        mine = tuple(request.block_hashes.get("self", ()))[: len(params.block_hashes["self"])]
        if mine != params.block_hashes["self"]:
            raise WireError("prefill's block hashes do not match this prompt (wrong tokens?)")

    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: Mapping[str, Sequence[BlockId]],
        num_external_tokens: int,
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        first, k = pending.first_block, pending.offload_blocks
        offload_hashes = tuple(request.block_hashes.get("self", ())[first : first + k])
        params = pending.params
        if params is None:  # blocks from the offload daemon only
            self._loads.append(
                BlockLoad(
                    request_id=request.request_id,
                    remote_engine="",
                    remote_address="",
                    local_ids={"self": tuple(block_ids["self"][first : first + k])},
                    remote_ids={},
                    offload_hashes=offload_hashes,
                )
            )
            return
        end = -(-params.num_tokens // self.block_size)
        local = {"self": tuple(block_ids["self"][pending.first_block : end])}
        remote = {"self": params.block_ids["self"][pending.first_block : end]}
        hashes = {"self": params.block_hashes["self"][pending.first_block :]}
        if self._load_cross(request, block_ids, params):
            local["cross"] = tuple(block_ids["cross"])
            remote["cross"] = params.block_ids["cross"]
            hashes["cross"] = params.block_hashes["cross"]
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
            )
        )

    @staticmethod
    def _load_cross(
        request: RequestView, block_ids: Mapping[str, Sequence[BlockId]], params: KVTransferParams
    ) -> bool:
        """Whether to load prefill's cross blocks: the engine needs them and they are the
        blocks of this request's encoder input."""
        wanted = tuple(block_ids.get("cross", ()))
        if not wanted:
            return False
        theirs = params.block_hashes.get("cross", ())
        if theirs != tuple(request.block_hashes.get("cross", ())) or len(theirs) != len(wanted):
            log.info(
                "request %s: prefill's cross blocks are not this encoder input's; "
                "computing them here",
                request.request_id,
            )
            return False
        return True

    def build_connector_meta(self) -> StepMetadata:
        loads, self._loads = tuple(self._loads), []
        stores, self._stores = tuple(self._stores), []
        return StepMetadata(loads=loads, stores=stores)

    # ----- prefill -------------------------------------------------------------------------
    def request_finished(
        self, request: RequestView, block_ids: Mapping[str, Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        delay_free = self._store(request, block_ids)
        raw = request.kv_transfer_params
        if not self.config.produces or not raw or not raw.get("do_remote_decode"):
            return delay_free, None
        ids = {g: list(b) for g, b in block_ids.items() if b}
        if not ids.get("self") or self.issuer is None:
            return delay_free, None
        num_tokens = len(request.prompt_token_ids)
        needed = -(-num_tokens // self.block_size)
        ids["self"] = ids["self"][:needed]
        hashes = {
            "self": list(request.block_hashes.get("self", ()))[: num_tokens // self.block_size]
        }
        cross_hashes = list(request.block_hashes.get("cross", ()))
        if ids.get("cross") and len(ids["cross"]) == len(cross_hashes):
            hashes["cross"] = cross_hashes
        else:
            ids.pop("cross", None)
        try:
            lease_id, ttl_s = self.issuer.lease_request(request.request_id, ids, hashes)
        except KVBridgeError as exc:
            log.warning(
                "request %s: could not pin its blocks (%s); decode will recompute",
                request.request_id,
                exc,
            )
            return delay_free, None
        params = KVTransferParams(
            remote_engine_id=self.config.engine_id,  # type: ignore[arg-type]
            remote_address=self.config.control_address,
            request_id=request.request_id,
            num_tokens=num_tokens,
            block_ids={g: tuple(v) for g, v in ids.items()},  # type: ignore[misc]
            block_hashes={g: tuple(v) for g, v in hashes.items()},
            lease_id=lease_id,
            lease_ttl_s=ttl_s,
        )
        return delay_free, params.to_dict()

    def _store(self, request: RequestView, block_ids: Mapping[str, Sequence[BlockId]]) -> bool:
        """Queue the request's verified full blocks for the offload daemon; True if queued
        (the engine then keeps the blocks until the worker reports the store done)."""
        if self.offload_lookup is None or self.issuer is None:
            return False
        ids = list(block_ids.get("self", ()))
        hashes = list(request.block_hashes.get("self", ()))[: len(ids)]
        # only blocks the engine itself holds under exactly these names: never store
        # a block of an aborted request whose KV was not written whole
        n = self.issuer.verified_prefix("self", ids[: len(hashes)], hashes)
        if n <= 0:
            return False
        self._stores.append(BlockStore(request.request_id, tuple(ids[:n]), tuple(hashes[:n])))
        return True

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.base import BlockLoad, RequestView, SchedulerConnector, StepMetadata
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.params import KVTransferParams
from kvbridge.proto.errors import KVBridgeError, WireError
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = ["KVBridgeScheduler", "LeaseIssuer"]

log = logging.getLogger(__name__)


class LeaseIssuer(ABC):
    """Pins a finished prefill request's blocks under a lease that a decode peer releases.

    Implemented by the process that owns the KV memory and runs the control
    server (:class:`kvbridge.worker.node.Node`); called from the scheduler thread.
    """

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
    params: KVTransferParams
    first_block: int


class KVBridgeScheduler(SchedulerConnector):
    """The scheduler half for kvbridge's own engines (and, through the adapter, vLLM)."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.issuer: LeaseIssuer | None = None
        self._pending: dict[RequestId, _Pending] = {}
        self._loads: list[BlockLoad] = []

    def attach(self, issuer: LeaseIssuer) -> None:
        """Give the prefill side its lease issuer (wired after the engine exists)."""
        self.issuer = issuer

    # ----- decode --------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        raw = request.kv_transfer_params
        if not self.config.consumes or not KVTransferParams.is_remote_prefill(raw):
            return 0, False
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
        self._pending[request.request_id] = _Pending(params, num_computed_tokens // self.block_size)
        return external, True

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
        params = pending.params
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
        return StepMetadata(loads=loads)

    # ----- prefill -------------------------------------------------------------------------
    def request_finished(
        self, request: RequestView, block_ids: Mapping[str, Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        raw = request.kv_transfer_params
        if not self.config.produces or not raw or not raw.get("do_remote_decode"):
            return False, None
        ids = {g: list(b) for g, b in block_ids.items() if b}
        if not ids.get("self") or self.issuer is None:
            return False, None
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
            return False, None
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
        return False, params.to_dict()

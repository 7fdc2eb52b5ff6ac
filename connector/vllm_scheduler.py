"""The scheduler half of kvbridge inside vLLM: which blocks a request loads, what prefill hands
over, and which of its blocks the worker must hold for decode.

Runs in vLLM's scheduler (the EngineCore process); the KV memory lives in the
worker processes, so nothing here pins memory. It imports no vLLM: the adapter
(:mod:`kvbridge.connector.vllm`) unpacks vLLM's objects into plain values.

vLLM's conventions, which differ from kvbridge's own router and
:class:`~kvbridge.connector.scheduler.KVBridgeScheduler`:

- decode gets the **original prompt** (vLLM's proxies send it unchanged) and
  vLLM recomputes its last token to sample; a prompt of ``num_tokens + 1``
  (prompt plus prefill's first token, kvbridge's router) is accepted too;
- a finished prefill request's blocks are held by vLLM's ``delay_free``:
  :meth:`VllmScheduler.request_finished` answers ``True`` and orders a
  :class:`HoldOrder` that the worker turns into a lease; vLLM frees the blocks
  when the worker reports the request in ``get_finished(done_sending)``;
- ``kv_transfer_params`` travel through vLLM's JSON API, so block hashes are
  hex strings on that side (:func:`to_json_params` / :func:`from_json_params`).

Block names are kvbridge's own (:class:`~kvbridge.proto.hashing.BlockHasher`),
not vLLM's ``request.block_hashes``: see ``docs/VLLM.md`` ("Hashing").
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.base import BlockLoad, StepMetadata
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.params import KVTransferParams
from kvbridge.proto.errors import WireError
from kvbridge.proto.hashing import BlockHasher
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = ["HoldOrder", "VllmScheduler", "to_json_params", "from_json_params"]

log = logging.getLogger(__name__)

_HASH_KEY = "block_hashes"


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


def to_json_params(params: KVTransferParams) -> dict[str, Any]:
    """``kv_transfer_params`` as vLLM's OpenAI API can carry them (hashes as hex)."""
    out: dict[str, Any] = params.to_dict()
    out[_HASH_KEY] = {g: [h.hex() for h in hs] for g, hs in params.block_hashes.items()}
    return out


def from_json_params(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`to_json_params`; a malformed hash becomes a WireError."""
    out = dict(raw)
    hashes = raw.get(_HASH_KEY)
    if isinstance(hashes, Mapping):
        try:
            out[_HASH_KEY] = {
                g: [bytes.fromhex(h) if isinstance(h, str) else h for h in hs]
                for g, hs in hashes.items()
            }
        except (TypeError, ValueError) as exc:
            raise WireError(f"kv_transfer_params: bad block hash ({exc})") from None
    return out


@dataclass(slots=True)
class _Pending:
    params: KVTransferParams
    first_block: int


class VllmScheduler:
    """Decode-side load planning and prefill-side hand-over for one vLLM engine."""

    def __init__(self, config: ConnectorConfig, block_size: int, hasher: BlockHasher) -> None:
        self.config = config
        self.block_size = block_size
        self.hasher = hasher
        self._pending: dict[RequestId, _Pending] = {}
        self._loads: list[BlockLoad] = []
        self._holds: list[HoldOrder] = []
        self._loaded: set[RequestId] = set()
        """Requests whose load was planned: after a failed load vLLM asks again, and the
        answer is then 0 (recompute), never a second try at the same lease."""

    # ----- decode --------------------------------------------------------------------------
    def num_matched(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        raw_params: Mapping[str, Any] | None,
        num_computed_tokens: int,
    ) -> tuple[int, bool]:
        """Tokens to load beyond the local prefix hit; side-effect free apart from the plan."""
        if (
            not self.config.consumes
            or request_id in self._loaded
            or not KVTransferParams.is_remote_prefill(raw_params)
        ):
            return 0, False
        assert raw_params is not None
        try:
            params = KVTransferParams.parse(from_json_params(raw_params), self.block_size)
            self._check_prompt(prompt, params)
        except WireError as exc:
            log.warning("request %s: not loading remote KV (%s); recomputing", request_id, exc)
            return 0, False
        external = params.num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        self._pending[request_id] = _Pending(params, num_computed_tokens // self.block_size)
        return external, True

    def _check_prompt(self, prompt: Sequence[int], params: KVTransferParams) -> None:
        if len(prompt) not in (params.num_tokens, params.num_tokens + 1):
            raise WireError(
                f"prefill computed {params.num_tokens} tokens, decode got a prompt of "
                f"{len(prompt)} (expected the same prompt, or prompt + first token)"
            )
        theirs = params.block_hashes["self"]
        mine = self.hasher.hash_blocks(list(prompt[: len(theirs) * self.block_size]))
        if tuple(mine) != theirs:
            raise WireError(
                "prefill's block hashes do not match this prompt (other tokens, or another "
                "hash seed/model on the prefill side?)"
            )

    def after_alloc(
        self, request_id: RequestId, block_ids: Sequence[BlockId], num_external_tokens: int
    ) -> None:
        """vLLM allocated ``block_ids`` (the request's whole block table)."""
        pending = self._pending.pop(request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        self._loaded.add(request_id)
        params = pending.params
        first, end = pending.first_block, -(-params.num_tokens // self.block_size)
        self._loads.append(
            BlockLoad(
                request_id=request_id,
                remote_engine=params.remote_engine_id,
                remote_address=params.remote_address,
                local_ids={"self": tuple(block_ids[first:end])},
                remote_ids={"self": params.block_ids["self"][first:end]},
                lease_id=params.lease_id,
                remote_hashes={"self": params.block_hashes["self"][first:]},
            )
        )

    def build_step(self) -> tuple[StepMetadata, tuple[HoldOrder, ...]]:
        """This step's loads and hold orders; resets both."""
        loads, self._loads = tuple(self._loads), []
        holds, self._holds = tuple(self._holds), []
        return StepMetadata(loads=loads), holds

    # ----- prefill -------------------------------------------------------------------------
    def request_finished(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        raw_params: Mapping[str, Any] | None,
        block_ids: Sequence[BlockId],
        prompt_done: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a finished or aborted request."""
        self._pending.pop(request_id, None)
        self._loaded.discard(request_id)
        if not self.config.produces or not raw_params or not raw_params.get("do_remote_decode"):
            return False, None
        num_tokens = len(prompt)
        needed = -(-num_tokens // self.block_size)
        if not prompt_done or len(block_ids) < needed:
            log.info("request %s finished before its prompt was computed; no hand-over", request_id)
            return False, None
        ids = tuple(BlockId(b) for b in block_ids[:needed])
        hashes = tuple(self.hasher.hash_blocks(list(prompt)))
        lease_id = LeaseId(secrets.token_hex(16))
        self._holds.append(HoldOrder(request_id, lease_id, ids, hashes, self.config.lease_ttl_s))
        params = KVTransferParams(
            remote_engine_id=self.config.engine_id,  # type: ignore[arg-type]
            remote_address=self.config.control_address,
            request_id=request_id,
            num_tokens=num_tokens,
            block_ids={"self": ids},
            block_hashes={"self": hashes},
            lease_id=lease_id,
            lease_ttl_s=self.config.lease_ttl_s,
        )
        return True, to_json_params(params)

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

With an offload daemon (``offload_lookup``), every request (remote prefill or
not) first takes vLLM's own prefix-cache hit, then the daemon's leading hits
after it; a decode loads those from the daemon and only the rest from
prefill. A request that finished normally stores its full prompt blocks in
the daemon: ``request_finished`` answers ``delay_free`` and the worker
reports the request in ``done_sending`` once the store (and any hold for a
decode peer) is over, so vLLM never reuses a block the daemon is still
copying.

Block names are kvbridge's own (:class:`~kvbridge.proto.hashing.BlockHasher`),
not vLLM's ``request.block_hashes``: see ``docs/VLLM.md`` ("Hashing").
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.base import BlockLoad, BlockStore, StepMetadata
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
    params: KVTransferParams | None
    """Prefill's answer; None for a load from the offload daemon alone."""
    first_block: int
    offload_hashes: tuple[BlockHash, ...] = ()
    """Names of the blocks after ``first_block`` that the offload daemon holds."""


class VllmScheduler:
    """Decode-side load planning and prefill-side hand-over for one vLLM engine."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        hasher: BlockHasher,
        offload_lookup: Callable[[Sequence[BlockHash]], int] | None = None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.hasher = hasher
        self.offload_lookup = offload_lookup
        """With an offload daemon: how many leading blocks of a prefix it holds."""
        self._pending: dict[RequestId, _Pending] = {}
        self._loads: list[BlockLoad] = []
        self._stores: list[BlockStore] = []
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
        if request_id in self._loaded:
            return 0, False
        first = num_computed_tokens // self.block_size
        if not (self.config.consumes and KVTransferParams.is_remote_prefill(raw_params)):
            return self._offload_only(request_id, prompt, first)
        assert raw_params is not None
        try:
            params = KVTransferParams.parse(from_json_params(raw_params), self.block_size)
            mine = self._check_prompt(prompt, params)
        except WireError as exc:
            log.warning("request %s: not loading remote KV (%s); recomputing", request_id, exc)
            return 0, False
        external = params.num_tokens - num_computed_tokens
        if external <= 0:
            return 0, False
        hits = self._lookup(mine[first:])
        self._pending[request_id] = _Pending(params, first, mine[first : first + hits])
        return external, True

    def _offload_only(
        self, request_id: RequestId, prompt: Sequence[int], first: int
    ) -> tuple[int, bool]:
        """Blocks after the local prefix that the offload daemon holds (no remote prefill);
        the last prompt token is always left for vLLM to compute."""
        last = (len(prompt) - 1) // self.block_size
        if self.offload_lookup is None or last <= first:
            return 0, False
        names = self.hasher.hash_blocks(list(prompt[: last * self.block_size]))
        hits = self._lookup(names[first:])
        if hits <= 0:
            return 0, False
        self._pending[request_id] = _Pending(None, first, tuple(names[first : first + hits]))
        return hits * self.block_size, True

    def _lookup(self, hashes: Sequence[BlockHash]) -> int:
        if self.offload_lookup is None or not hashes:
            return 0
        return max(0, min(len(hashes), self.offload_lookup(hashes)))

    def _check_prompt(
        self, prompt: Sequence[int], params: KVTransferParams
    ) -> tuple[BlockHash, ...]:
        """This prompt's names of prefill's full blocks; WireError if they differ."""
        if len(prompt) not in (params.num_tokens, params.num_tokens + 1):
            raise WireError(
                f"prefill computed {params.num_tokens} tokens, decode got a prompt of "
                f"{len(prompt)} (expected the same prompt, or prompt + first token)"
            )
        theirs = params.block_hashes["self"]
        mine = tuple(self.hasher.hash_blocks(list(prompt[: len(theirs) * self.block_size])))
        if mine != theirs:
            raise WireError(
                "prefill's block hashes do not match this prompt (other tokens, or another "
                "hash seed/model on the prefill side?)"
            )
        return mine

    def after_alloc(
        self, request_id: RequestId, block_ids: Sequence[BlockId], num_external_tokens: int
    ) -> None:
        """vLLM allocated ``block_ids`` (the request's whole block table)."""
        pending = self._pending.pop(request_id, None)
        if pending is None or num_external_tokens <= 0:
            return
        self._loaded.add(request_id)
        params, first = pending.params, pending.first_block
        if params is None:  # blocks from the offload daemon only
            k = len(pending.offload_hashes)
            self._loads.append(
                BlockLoad(
                    request_id=request_id,
                    remote_engine="",
                    remote_address="",
                    local_ids={"self": tuple(block_ids[first : first + k])},
                    remote_ids={},
                    offload_hashes=pending.offload_hashes,
                )
            )
            return
        end = -(-params.num_tokens // self.block_size)
        self._loads.append(
            BlockLoad(
                request_id=request_id,
                remote_engine=params.remote_engine_id,
                remote_address=params.remote_address,
                local_ids={"self": tuple(block_ids[first:end])},
                remote_ids={"self": params.block_ids["self"][first:end]},
                lease_id=params.lease_id,
                remote_hashes={"self": params.block_hashes["self"][first:]},
                offload_hashes=pending.offload_hashes,
            )
        )

    def build_step(self) -> tuple[StepMetadata, tuple[HoldOrder, ...]]:
        """This step's loads, offload stores and hold orders; resets them."""
        loads, self._loads = tuple(self._loads), []
        stores, self._stores = tuple(self._stores), []
        holds, self._holds = tuple(self._holds), []
        return StepMetadata(loads=loads, stores=stores), holds

    # ----- prefill -------------------------------------------------------------------------
    def request_finished(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        raw_params: Mapping[str, Any] | None,
        block_ids: Sequence[BlockId],
        prompt_done: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a finished or aborted request.

        ``prompt_done``: the request finished normally with its whole prompt
        computed, so its full prompt blocks hold the prompt's KV.
        """
        self._pending.pop(request_id, None)
        self._loaded.discard(request_id)
        if not prompt_done:
            if raw_params and raw_params.get("do_remote_decode"):
                log.info(
                    "request %s ended before its prompt was computed; no hand-over", request_id
                )
            return False, None
        hand_over = bool(self.config.produces and raw_params and raw_params.get("do_remote_decode"))
        if self.offload_lookup is None and not hand_over:
            return False, None
        names = tuple(self.hasher.hash_blocks(list(prompt)))
        stored = self._store(request_id, block_ids, names)
        if not hand_over:
            return stored, None
        num_tokens = len(prompt)
        needed = -(-num_tokens // self.block_size)
        if len(block_ids) < needed:
            log.warning(
                "request %s has %d blocks for %d tokens", request_id, len(block_ids), needed
            )
            return stored, None
        ids = tuple(BlockId(b) for b in block_ids[:needed])
        lease_id = LeaseId(secrets.token_hex(16))
        self._holds.append(HoldOrder(request_id, lease_id, ids, names, self.config.lease_ttl_s))
        params = KVTransferParams(
            remote_engine_id=self.config.engine_id,  # type: ignore[arg-type]
            remote_address=self.config.control_address,
            request_id=request_id,
            num_tokens=num_tokens,
            block_ids={"self": ids},
            block_hashes={"self": names},
            lease_id=lease_id,
            lease_ttl_s=self.config.lease_ttl_s,
        )
        return True, to_json_params(params)

    def _store(
        self, request_id: RequestId, block_ids: Sequence[BlockId], names: Sequence[BlockHash]
    ) -> bool:
        """Order the worker to store the full prompt blocks in the offload daemon; True if
        ordered (vLLM must then keep the blocks until the worker reports the store done)."""
        n = min(len(names), len(block_ids))
        if self.offload_lookup is None or n == 0:
            return False
        self._stores.append(
            BlockStore(request_id, tuple(BlockId(b) for b in block_ids[:n]), tuple(names[:n]))
        )
        return True

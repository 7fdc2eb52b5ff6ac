"""A request's state inside the engine, and what the engine reports about it.

State machine::

    WAITING --admit--> RUNNING ------------------------------> FINISHED
       |                  ^                                        ^
       |  (connector: external tokens)                             |
       +--admit--> WAITING_FOR_REMOTE_KVS --done_receiving--+      |
                                                             abort +
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connector.base import RequestView
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, RequestId

__all__ = ["Request", "RequestOutput", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's progress after a step (or its final state when ``finished``)."""

    request_id: RequestId
    new_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    """``length`` (max_tokens reached) or ``abort``; None while running."""
    kv_transfer_params: dict[str, Any] | None
    """From the connector's ``request_finished`` (prefill side of P/D), else None."""
    num_prompt_tokens: int
    blocks_local_hit: int
    """Prompt blocks taken from this engine's prefix cache."""
    blocks_loaded: int
    """Blocks whose KV the connector loaded (external tokens), failed loads excluded."""
    blocks_recomputed: int
    """Blocks the connector was to load but whose load failed, so they were recomputed."""
    num_computed_tokens: int
    """Tokens this engine ran through the model for the request."""
    ttft_s: float | None
    """Seconds from ``add_request`` to the first token this engine sampled."""
    cross_blocks: int = 0
    """Cross-attention blocks of the request (encoder-decoder), 0 for a decoder-only model."""
    cross_source: str = ""
    """Where its cross KV came from: ``hit`` (this engine's cache), ``loaded`` (the connector)
    or ``computed`` (the encoder ran here); empty for a decoder-only model."""


@dataclass(slots=True, eq=False)
class Request:
    """Mutable scheduler-side state of one request; owned by the scheduler."""

    request_id: RequestId
    prompt_token_ids: list[int]
    max_tokens: int
    block_hashes: list[BlockHash]
    kv_transfer_params: Mapping[str, Any] | None = None
    encoder_input: bytes | None = None
    encoder_hash: bytes | None = None
    cross_hashes: list[BlockHash] = field(default_factory=list)
    """Names of the request's cross blocks (from the encoder input hash)."""
    cross_block_ids: list[BlockId] = field(default_factory=list)
    cross_ready: bool = False
    """The cross blocks hold this request's cross K/V (a hit, a finished load, or computed)."""
    cross_loading: bool = False
    """The connector is loading the cross blocks (set from the step's metadata)."""
    cross_source: str = ""
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[BlockId] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Positions ``0 .. num_computed_tokens-1`` have KV in ``block_ids`` (or are loading)."""
    num_cached_blocks: int = 0
    """Leading blocks that are in the prefix cache (or hold exactly what it would)."""
    finish_reason: str | None = None
    # reporting
    blocks_local_hit: int = 0
    load_start_block: int = 0
    load_end_block: int = 0
    """Blocks ``load_start_block .. load_end_block-1`` receive external KV."""
    blocks_recomputed: int = 0
    sync_load: bool = False
    num_model_tokens: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # blocks stay referenced while the connector may still read or write them
    pending_send: bool = False
    pending_recv: bool = False
    finished_params: dict[str, Any] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def view(self) -> RequestView:
        hashes = {KVGroup.SELF: tuple(self.block_hashes)}
        if self.cross_hashes:
            hashes[KVGroup.CROSS] = tuple(self.cross_hashes)
        return RequestView(
            request_id=self.request_id,
            prompt_token_ids=tuple(self.prompt_token_ids),
            block_hashes=hashes,
            kv_transfer_params=self.kv_transfer_params,
            encoder_hash=self.encoder_hash,
            prompt_computed=self.finish_reason != "abort"
            and self.num_computed_tokens >= len(self.prompt_token_ids),
        )

    def output(self, new_token_ids: tuple[int, ...]) -> RequestOutput:
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            output_token_ids=tuple(self.output_token_ids),
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            kv_transfer_params=self.finished_params,
            num_prompt_tokens=len(self.prompt_token_ids),
            blocks_local_hit=self.blocks_local_hit,
            blocks_loaded=self.load_end_block - self.load_start_block - self.blocks_recomputed,
            blocks_recomputed=self.blocks_recomputed,
            num_computed_tokens=self.num_model_tokens,
            ttft_s=ttft,
            cross_blocks=len(self.cross_hashes),
            cross_source=self.cross_source,
        )

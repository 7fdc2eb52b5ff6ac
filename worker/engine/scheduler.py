"""The reference engine's scheduler: admission, prefix caching, chunking, finishing.

Policy, kept deliberately simple so that outputs are bit-for-bit reproducible:

* **FCFS admission with the whole block table.** A request is admitted only if
  every block it can ever need (``prompt + max_tokens - 1`` tokens) is free, so
  nothing is ever preempted.
* **Prefix caching.** A prompt's full blocks are named by
  :class:`~kvbridge.proto.hashing.BlockHasher`; admission takes the longest
  cached prefix (at most ``(len(prompt) - 1) // block_size`` blocks, so there is
  always a token to compute) with :meth:`BlockPool.touch`.
* **One block per chunk.** Each step runs one forward per running request over
  the tokens from ``num_computed_tokens`` up to the next block boundary (a
  decode step is a one-token chunk). Computing block *k* therefore depends only
  on the KV bytes of blocks ``< k``, wherever they came from.
* **Only canonical blocks are cached.** A block enters the prefix cache when it
  was computed as one whole aligned chunk, or loaded whole, and every block
  before it is cached too: its bytes then equal those of a cold run over any
  prompt that contains it.

Connector hooks (:mod:`kvbridge.connector.base`) are called in vLLM's order:
``get_num_new_matched_tokens`` after local hits, ``update_state_after_alloc``
after allocation, ``build_connector_meta`` once per :meth:`schedule`, and
``request_finished`` when a request finishes or is aborted. A request with
external tokens waits in ``WAITING_FOR_REMOTE_KVS`` for at least the step
that loads them (until ``done_receiving`` if the load is asynchronous); load
errors reported by then roll it back to its first bad block (fail closed).
Blocks of a finished request stay referenced while the connector may still read
them (``delay_free`` until ``done_sending``) or write them (an aborted load,
until ``done_receiving``).

**Cross-attention blocks** (encoder-decoder) are one table per request, all cached or
all fresh: :mod:`.block_tables`.

Every pool operation holds :attr:`Scheduler.lock`, because the control server
pins and unpins blocks from other threads. Connector hooks run without it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from kvbridge.connector.base import SchedulerConnector, StepMetadata
from kvbridge.connector.events import BlockEventSink
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.hashing import BlockHasher, HashConfig
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.types import BlockId, RequestId
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.engine.block_tables import (
    allocate_cross,
    blocks_needed,
    cache_cross,
    cross_fits,
    fits,
)
from kvbridge.worker.engine.intake import check_request, name_request
from kvbridge.worker.engine.request import Request, RequestOutput, RequestStatus

__all__ = ["Scheduler", "ScheduledChunk", "SchedulerOutput"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Run tokens ``start .. end-1`` of ``request``; sample after them if ``sample``."""

    request: Request
    start: int
    end: int
    sample: bool
    compute_cross: bool = False
    """Run the encoder and write the request's cross K/V before this chunk."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    metadata: StepMetadata
    finished_request_ids: frozenset[RequestId]
    """Requests finished since the previous step (for the worker's ``get_finished``)."""


class Scheduler:
    """Owns requests and block pools; single-threaded apart from :attr:`lock`."""

    def __init__(
        self,
        layout: KVLayout,
        connector: SchedulerConnector | None = None,
        hash_config: HashConfig | None = None,
        events: BlockEventSink | None = None,
    ) -> None:
        """``events`` hears what enters and leaves the prefix cache (decoder group only)."""
        self.layout = layout
        self.block_size = layout.block_size
        self.connector = connector
        self.hasher = BlockHasher(layout.fingerprint(), layout.block_size, hash_config)
        self.lock = threading.Lock()
        """Guards every operation on :attr:`pools`."""
        self.pools: dict[KVGroup, BlockPool] = {
            g.name: BlockPool(g.num_blocks, events=events if g.name == KVGroup.SELF else None)
            for g in layout.groups
        }
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admitted: RUNNING or WAITING_FOR_REMOTE_KVS
        self._held: dict[RequestId, Request] = {}  # finished, blocks still lent out
        self._finished_ids: set[RequestId] = set()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        request_id: str | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        encoder_input: bytes | None = None,
    ) -> Request:
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, max_tokens, encoder_input, self.pools, self.block_size)
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        if rid in self._held or any(r.request_id == rid for r in (*self._waiting, *self._running)):
            raise ConfigError(f"request id {rid!r} is already in use")
        request = name_request(
            self.hasher, self.pools, rid, prompt, max_tokens, kv_transfer_params, encoder_input
        )
        self._waiting.append(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now; None if it is unknown or already finished."""
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                request.status = RequestStatus.FINISHED
                request.finish_reason = "abort"
                if self.connector is not None:  # it may have pinned remote blocks already
                    self.connector.request_finished(request.view(), {KVGroup.SELF: []})
                return request.output(())
        for request in self._running:
            if request.request_id == request_id:
                self._finish(request, "abort")
                return request.output(())
        return None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def has_held_blocks(self) -> bool:
        """Whether finished requests still hold blocks for the connector."""
        return bool(self._held)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Admit what fits, then plan one chunk per running request."""
        while self._waiting and self._admit(self._waiting[0]):
            self._running.append(self._waiting.popleft())
        chunks = tuple(
            self._next_chunk(r) for r in self._running if r.status is RequestStatus.RUNNING
        )
        metadata = self.connector.build_connector_meta() if self.connector else StepMetadata()
        loading_cross = {x.request_id for x in metadata.loads if x.local_ids.get(KVGroup.CROSS)}
        for r in self._running:
            if r.request_id in loading_cross:
                r.cross_loading = True
        finished = frozenset(self._finished_ids)
        self._finished_ids.clear()
        return SchedulerOutput(chunks, metadata, finished)

    def update(
        self,
        scheduled: SchedulerOutput,
        sampled: Mapping[RequestId, int],
        done_sending: Set[RequestId] = frozenset(),
        done_receiving: Set[RequestId] = frozenset(),
        bad_blocks: Set[BlockId] = frozenset(),
    ) -> list[RequestOutput]:
        """Apply one step's model results and the worker connector's reports."""
        outputs = []
        for chunk in scheduled.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.end
            request.num_model_tokens += chunk.end - chunk.start
            if chunk.compute_cross:
                self._cross_done(request, "computed")
            self._cache_computed(request, chunk)
            if chunk.sample:
                token = sampled[request.request_id]
                request.output_token_ids.append(token)
                if request.first_token_time is None:
                    request.first_token_time = time.perf_counter()
                if len(request.output_token_ids) >= request.max_tokens:
                    self._finish(request, "length")
                outputs.append(request.output((token,)))
        if bad_blocks:
            outputs += self._apply_load_errors(bad_blocks)
        for request in list(self._running):
            loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
            if loading and (request.sync_load or request.request_id in done_receiving):
                self._resume(request)
        for rid in done_receiving:
            if rid in self._held:
                self._held[rid].pending_recv = False
                self._maybe_free(self._held[rid])
        for rid in done_sending:
            if rid in self._held:
                self._held[rid].pending_send = False
                self._maybe_free(self._held[rid])
            else:
                logger.debug("done_sending for unknown or released request %s", rid)
        return outputs

    # ------------------------------------------------------------------ helpers

    def _admit(self, request: Request) -> bool:
        """Take local hits, ask the connector, allocate the whole block table."""
        n = self.block_size
        num_prompt = len(request.prompt_token_ids)
        need = blocks_needed(num_prompt, request.max_tokens, n)
        candidates = request.block_hashes[: (num_prompt - 1) // n]
        pool = self.pools[KVGroup.SELF]
        with self.lock:
            hits = pool.lookup_prefix(candidates)
            if not fits(pool, hits, need) or not cross_fits(self.pools.get(KVGroup.CROSS), request):
                return False
        num_local = len(hits) * n
        num_external, is_async = 0, False
        if self.connector is not None:
            num_external, is_async = self.connector.get_num_new_matched_tokens(
                request.view(), num_local
            )
            if not 0 <= num_external <= num_prompt - 1 - num_local:
                logger.warning(
                    "request %s: connector offered %d external tokens, at most %d fit; clamped",
                    request.request_id,
                    num_external,
                    num_prompt - 1 - num_local,
                )
                num_external = max(0, min(num_external, num_prompt - 1 - num_local))
        with self.lock:
            # another thread may have pinned free blocks meanwhile: check again
            if (
                pool.lookup_prefix(candidates[: len(hits)]) != hits
                or not fits(pool, hits, need)
                or not cross_fits(self.pools.get(KVGroup.CROSS), request)
            ):
                return False
            pool.touch(hits)
            request.block_ids = hits + pool.allocate(need - len(hits))
            allocate_cross(self.pools.get(KVGroup.CROSS), request)
        request.blocks_local_hit = request.num_cached_blocks = len(hits)
        request.num_computed_tokens = num_local + num_external
        request.load_start_block = len(hits)
        request.load_end_block = -(-request.num_computed_tokens // n) if num_external else len(hits)
        if self.connector is not None:
            tables = {KVGroup.SELF: list(request.block_ids)}
            if request.cross_hashes and not request.cross_ready:
                tables[KVGroup.CROSS] = list(request.cross_block_ids)
            self.connector.update_state_after_alloc(request.view(), tables, num_external)
        if num_external:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.pending_recv = is_async
            request.sync_load = not is_async
        else:
            request.status = RequestStatus.RUNNING
        logger.debug(
            "admitted %s: %d blocks, %d local hits, %d external tokens (%s)",
            request.request_id,
            need,
            len(hits),
            num_external,
            "async" if is_async else "sync",
        )
        return True

    def _cross_done(self, request: Request, source: str) -> None:
        """The request's cross blocks now hold its cross K/V: cache them under their names."""
        with self.lock:
            cache_cross(self.pools[KVGroup.CROSS], request, source)

    def _next_chunk(self, request: Request) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = min((start // self.block_size + 1) * self.block_size, request.num_tokens)
        compute_cross = bool(request.cross_hashes) and not request.cross_ready
        return ScheduledChunk(
            request, start, end, sample=end == request.num_tokens, compute_cross=compute_cross
        )

    def _cache_computed(self, request: Request, chunk: ScheduledChunk) -> None:
        k, n = chunk.start // self.block_size, self.block_size
        whole = chunk.start % n == 0 and chunk.end - chunk.start == n
        if whole and k == request.num_cached_blocks and k < len(request.block_hashes):
            with self.lock:
                self.pools[KVGroup.SELF].cache_block(request.block_ids[k], request.block_hashes[k])
            request.num_cached_blocks += 1

    def _resume(self, request: Request) -> None:
        """The request's loads are done (minus reported errors): cache whole loaded blocks."""
        request.status = RequestStatus.RUNNING
        request.pending_recv = request.sync_load = False
        if request.cross_loading:
            self._cross_done(request, "loaded")
        whole = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        with self.lock:
            for k in range(request.num_cached_blocks, whole):
                self.pools[KVGroup.SELF].cache_block(request.block_ids[k], request.block_hashes[k])
        request.num_cached_blocks = max(request.num_cached_blocks, whole)

    def _apply_load_errors(self, bad_blocks: Set[BlockId]) -> list[RequestOutput]:
        """Roll loading requests back to their first bad block; fail running ones."""
        outputs = []
        n = self.block_size
        for request in list(self._running):
            bad = [i for i, b in enumerate(request.block_ids) if b in bad_blocks]
            if not bad:
                continue
            first = bad[0]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.cross_loading:  # fail closed: the encoder runs here instead
                    request.cross_loading = False
                logger.warning(
                    "request %s: load of block %d failed; recomputing %d block(s) from there",
                    request.request_id,
                    request.block_ids[first],
                    request.load_end_block - first,
                )
                request.num_computed_tokens = min(request.num_computed_tokens, first * n)
                request.blocks_recomputed = max(
                    request.blocks_recomputed, request.load_end_block - first
                )
            elif first * n < request.num_computed_tokens:
                logger.error(
                    "request %s: load error reported for block %d after it was used; "
                    "failing the request",
                    request.request_id,
                    request.block_ids[first],
                )
                self._finish(request, "error")
                outputs.append(request.output(()))
        return outputs

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._running.remove(request)
        self._finished_ids.add(request.request_id)
        delay_free, params = False, None
        if self.connector is not None:
            tables = {KVGroup.SELF: list(request.block_ids)}
            if request.cross_ready:
                tables[KVGroup.CROSS] = list(request.cross_block_ids)
            delay_free, params = self.connector.request_finished(request.view(), tables)
        request.finished_params = params
        request.pending_send = delay_free
        self._held[request.request_id] = request
        self._maybe_free(request)

    def _maybe_free(self, request: Request) -> None:
        if request.pending_send or request.pending_recv:
            return
        with self.lock:
            self.pools[KVGroup.SELF].free(request.block_ids)
            if request.cross_block_ids:
                self.pools[KVGroup.CROSS].free(request.cross_block_ids)
        del self._held[request.request_id]

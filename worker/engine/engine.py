"""``Engine``: the model, its paged KV cache and the scheduler, stepped in one process.

It plays both of vLLM's roles for the connector: the scheduler half is called
from :class:`~kvbridge.worker.engine.scheduler.Scheduler`, the worker half from
:meth:`Engine.step`, in the order :mod:`kvbridge.connector.base` documents::

    plan = scheduler.schedule()                 # admission hooks, build_connector_meta
    worker.start_load_kv(plan.metadata)
    for chunk in plan.chunks: model.forward()   # wait_for_layer_load / save_kv_layer
    worker.wait_for_save()
    sending, receiving = worker.get_finished(plan.finished_request_ids)
    bad = worker.get_block_ids_with_load_errors()
    scheduler.update(...)                       # request_finished for finished ones

Each request is computed on its own (no batching across requests), so its
output never depends on what else is running.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvbridge.connector.base import SchedulerConnector, WorkerConnector
from kvbridge.connector.events import BlockEventSink
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.types import RequestId
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.engine.config import EngineConfig
from kvbridge.worker.engine.model import CrossKV, DecoderModel
from kvbridge.worker.engine.request import RequestOutput
from kvbridge.worker.engine.scheduler import Scheduler

__all__ = ["Engine"]


class Engine:
    """A reference LLM engine with greedy sampling and prefix caching."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        connector_scheduler: SchedulerConnector | None = None,
        connector_worker: WorkerConnector | None = None,
        device: str = "cpu",
        events: BlockEventSink | None = None,
    ) -> None:
        """``events``: KV events of the prefix cache (what enters and leaves it)."""
        self.config = config
        self.model = DecoderModel(config, device)
        layout = config.layout()
        self.kv_caches: dict[str, torch.Tensor] = layout.allocate(device)
        self.layout: KVLayout = layout.bind(self.kv_caches)
        self.scheduler = Scheduler(self.layout, connector_scheduler, events=events)
        self.connector_worker = connector_worker
        if connector_worker is not None:
            connector_worker.register_kv_caches(self.kv_caches, self.layout)
        self.num_forwards = 0
        self.num_tokens_computed = 0
        self.num_encoder_runs = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        request_id: str | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        encoder_input: bytes | None = None,
    ) -> RequestId:
        """Queue a request; returns its id.

        For the decode side of P/D pass the original prompt plus the first token
        that prefill sampled as ``prompt_token_ids``, prefill's answer as
        ``kv_transfer_params`` and ``max_tokens`` minus one: the connector then
        loads the prompt's KV and this engine computes from the first token on.

        An encoder-decoder engine (``config.encoder_decoder``) needs ``encoder_input``
        (one encoder position per byte, at most ``config.max_encoder_len``); a second
        request with the same bytes reuses the cross-attention blocks of the first.
        """
        if encoder_input is not None and len(encoder_input) > self.config.max_encoder_len:
            raise ConfigError(
                f"encoder_input has {len(encoder_input)} bytes, more than max_encoder_len="
                f"{self.config.max_encoder_len}"
            )
        vocab = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
        request = self.scheduler.add_request(
            prompt_token_ids, max_tokens, request_id, kv_transfer_params, encoder_input
        )
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (``finish_reason="abort"``); None if unknown or finished."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_held_blocks(self) -> bool:
        """Whether finished requests still hold blocks for the connector (e.g. until
        decode has read them); keep calling :meth:`step` to reap them."""
        return self.scheduler.has_held_blocks()

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """One scheduling step: at most one forward (one chunk) per running request."""
        plan = self.scheduler.schedule()
        worker = self.connector_worker
        if worker is not None:
            worker.start_load_kv(plan.metadata)
        sampled: dict[RequestId, int] = {}
        for chunk in plan.chunks:
            request = chunk.request
            device = self.model.device
            table = torch.tensor(request.block_ids, dtype=torch.long, device=device)
            cross = None
            if request.encoder_input:
                cross_table = torch.tensor(request.cross_block_ids, dtype=torch.long, device=device)
                cross = CrossKV(cross_table, len(request.encoder_input))
                if chunk.compute_cross:
                    encoded = self.model.encode(request.encoder_input)
                    self.model.write_cross_kv(encoded, cross, self.kv_caches)
                    self.num_encoder_runs += 1
            logits = self.model.forward(
                request.all_token_ids[chunk.start : chunk.end],
                chunk.start,
                table,
                self.kv_caches,
                worker,
                cross=cross,
                skip_tail=self.config.prefill_skip,
                sample=chunk.sample,
            )
            self.num_forwards += 1
            self.num_tokens_computed += chunk.end - chunk.start
            if chunk.sample:
                assert logits is not None
                sampled[request.request_id] = int(torch.argmax(logits).item())
        if worker is None:
            return self.scheduler.update(plan, sampled)
        worker.wait_for_save()
        sending, receiving = worker.get_finished(set(plan.finished_request_ids))
        bad = worker.get_block_ids_with_load_errors()
        return self.scheduler.update(plan, sampled, sending, receiving, bad)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        encoder_inputs: Sequence[bytes | None] | None = None,
    ) -> list[list[int]]:
        """Greedy completions of ``prompts``, in order (a convenience for tests and demos)."""
        encs = list(encoder_inputs) if encoder_inputs is not None else [None] * len(prompts)
        ids = [
            self.add_request(p, max_tokens, encoder_input=e)
            for p, e in zip(prompts, encs, strict=True)
        ]
        results: dict[RequestId, list[int]] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    results[out.request_id] = list(out.output_token_ids)
        return [results[i] for i in ids]

    # ------------------------------------------------------------------ state

    @property
    def lock(self) -> threading.Lock:
        """The lock that guards every operation on :attr:`pools`."""
        return self.scheduler.lock

    @property
    def pools(self) -> dict[KVGroup, BlockPool]:
        return self.scheduler.pools

    def num_free_blocks(self, group: KVGroup = KVGroup.SELF) -> int:
        with self.scheduler.lock:
            return self.pools[group].num_free_blocks

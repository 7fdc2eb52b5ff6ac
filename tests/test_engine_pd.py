"""Prefill/decode through the engine's connector hooks, with an in-process fake connector.

The fakes stand in for kvbridge's real connector: the prefill half hands out
its block ids when a request finishes and keeps them (``delay_free``) until
decode says it has read them; the decode half plans loads of the blocks after
its own prefix-cache hits and copies them per layer with torch indexing.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from kvbridge.connector import (
    BlockLoad,
    RequestView,
    SchedulerConnector,
    StepMetadata,
    WorkerConnector,
)
from kvbridge.proto import BlockId, KVLayout, RequestId
from kvbridge.worker.engine import Engine, EngineConfig, RequestOutput, RequestStatus
from tests.harness.engine import run_to_end

BLOCK = 16

pytestmark = pytest.mark.usefixtures("one_thread")


class Wire:
    """What the two engines share: prefill's KV tensors and decode's release notices."""

    def __init__(self) -> None:
        self.prefill_caches: Mapping[str, torch.Tensor] = {}
        self.released: set[RequestId] = set()


class PrefillScheduler(SchedulerConnector):
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: Mapping[str, Sequence[BlockId]],
        num_external_tokens: int,
    ) -> None:
        assert num_external_tokens == 0

    def build_connector_meta(self) -> StepMetadata:
        return StepMetadata()

    def request_finished(
        self, request: RequestView, block_ids: Mapping[str, Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return False, None
        return True, {
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids["self"]),
            "num_prompt_tokens": len(request.prompt_token_ids),
        }


class PrefillWorker(WorkerConnector):
    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVLayout) -> None:
        self.wire.prefill_caches = kv_caches

    def start_load_kv(self, metadata: StepMetadata) -> None:
        assert not metadata.loads

    def get_finished(
        self, finished_request_ids: set[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        sending, self.wire.released = self.wire.released, set()
        return sending, set()

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        return set()


class DecodeScheduler(SchedulerConnector):
    """Loads every prompt token after the local hits from prefill's blocks."""

    def __init__(self, block_size: int, is_async: bool) -> None:
        self.block_size = block_size
        self.is_async = is_async
        self.local_tokens: dict[RequestId, int] = {}
        self.loads: list[BlockLoad] = []
        self.finished: list[RequestId] = []

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if "remote_block_ids" not in params:
            return 0, False
        self.local_tokens[request.request_id] = num_computed_tokens
        return max(params["num_prompt_tokens"] - num_computed_tokens, 0), self.is_async

    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: Mapping[str, Sequence[BlockId]],
        num_external_tokens: int,
    ) -> None:
        params = request.kv_transfer_params or {}
        if "remote_block_ids" not in params:
            return
        start = self.local_tokens.pop(request.request_id)
        first = start // self.block_size
        end = -(-(start + num_external_tokens) // self.block_size)
        self.loads.append(
            BlockLoad(
                request_id=request.request_id,
                remote_engine="prefill",
                remote_address="in-process",
                local_ids={"self": list(block_ids["self"][first:end])},
                remote_ids={"self": list(params["remote_block_ids"][first:end])},
            )
        )

    def build_connector_meta(self) -> StepMetadata:
        meta = StepMetadata(loads=tuple(self.loads))
        self.loads = []
        return meta

    def request_finished(
        self, request: RequestView, block_ids: Mapping[str, Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return False, None


class DecodeWorker(WorkerConnector):
    """Copies blocks per layer; can corrupt and report one block per load, or report late."""

    def __init__(self, wire: Wire, fail_index: int | None = None, delay: int = 0) -> None:
        self.wire = wire
        self.fail_index = fail_index
        self.delay = delay
        self.kv_caches: Mapping[str, torch.Tensor] = {}
        self.layout: KVLayout | None = None
        self.receiving: list[tuple[int, RequestId]] = []
        self.errors: set[BlockId] = set()
        self.calls: list[str] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVLayout) -> None:
        self.kv_caches, self.layout = kv_caches, layout

    def start_load_kv(self, metadata: StepMetadata) -> None:
        self.calls.append("start_load_kv")
        assert self.layout is not None
        for load in metadata.loads:
            local = torch.tensor(load.local_ids["self"], dtype=torch.long)
            remote = torch.tensor(load.remote_ids["self"], dtype=torch.long)
            for layer in self.layout.owning_layers("self"):
                dst, src = self.kv_caches[layer.name], self.wire.prefill_caches[layer.name]
                dst[:, local] = src[:, remote]
                if self.fail_index is not None and self.fail_index < len(local):
                    dst[:, local[self.fail_index]] = 1e4  # a torn transfer
            if self.fail_index is not None and self.fail_index < len(local):
                self.errors.add(BlockId(int(local[self.fail_index])))
            self.receiving.append((self.delay, load.request_id))
            self.wire.released.add(load.request_id)

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(
        self, finished_request_ids: set[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        self.calls.append("get_finished")
        done = {rid for wait, rid in self.receiving if wait == 0}
        self.receiving = [(wait - 1, rid) for wait, rid in self.receiving if wait > 0]
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        self.calls.append("get_block_ids_with_load_errors")
        errors, self.errors = self.errors, set()
        return errors


def make_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(count)]


def assert_all_blocks_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert not engine.has_held_blocks()
    assert engine.num_free_blocks() == engine.pools["self"].num_blocks


class Deployment:
    """One prefill and one decode engine wired by the fakes."""

    def __init__(
        self,
        prefill_order: str = "block-nhd",
        decode_order: str = "block-nhd",
        *,
        is_async: bool = True,
        fail_index: int | None = None,
        delay: int = 0,
    ) -> None:
        self.wire = Wire()
        self.prefill = Engine(
            EngineConfig(order=prefill_order),
            connector_scheduler=PrefillScheduler(),
            connector_worker=PrefillWorker(self.wire),
        )
        self.decode_scheduler = DecodeScheduler(BLOCK, is_async)
        self.decode_worker = DecodeWorker(self.wire, fail_index, delay)
        self.decode = Engine(
            EngineConfig(order=decode_order),
            connector_scheduler=self.decode_scheduler,
            connector_worker=self.decode_worker,
        )

    def prefill_all(self, prompts: Sequence[list[int]]) -> list[RequestOutput]:
        ids = [
            self.prefill.add_request(p, 1, kv_transfer_params={"do_remote_decode": True})
            for p in prompts
        ]
        final = run_to_end(self.prefill)
        assert self.prefill.has_held_blocks()  # delay_free: kept for decode
        return [final[i] for i in ids]

    def assert_no_leaks(self) -> None:
        for _ in range(2):
            self.prefill.step()
        assert_all_blocks_free(self.prefill)
        assert_all_blocks_free(self.decode)


def pd(
    dep: Deployment, prompts: Sequence[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[RequestOutput]]:
    """Prefill every prompt, then decode them together; returns the full token lists
    (prefill's first token, then decode's) and decode's outputs."""
    firsts = dep.prefill_all(prompts)
    ids = [
        dep.decode.add_request(
            [*p, f.output_token_ids[0]], max_tokens - 1, kv_transfer_params=f.kv_transfer_params
        )
        for p, f in zip(prompts, firsts, strict=True)
    ]
    final = run_to_end(dep.decode)
    dep.prefill.step()  # reaps done_sending
    outs = [final[i] for i in ids]
    tokens = [
        [f.output_token_ids[0], *o.output_token_ids] for f, o in zip(firsts, outs, strict=True)
    ]
    return tokens, outs


PROMPTS = make_prompts(2, 37, seed=11) + make_prompts(1, 47, seed=12) + make_prompts(1, 3, seed=13)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    torch.set_num_threads(1)
    return Engine(EngineConfig()).generate(PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(
    ("prefill_order", "decode_order", "is_async"),
    [
        ("block-nhd", "block-nhd", True),
        ("block-nhd", "layer-hnd", False),
        ("layer-kv-nhd", "block-hnd", True),
    ],
)
def test_decode_continues_exactly_where_a_single_process_run_would(
    single: list[list[int]], prefill_order: str, decode_order: str, is_async: bool
) -> None:
    dep = Deployment(prefill_order, decode_order, is_async=is_async)
    assert pd(dep, PROMPTS, MAX_TOKENS)[0] == single
    # decode computed only the first token onwards: one forward per generated token
    assert dep.decode.num_tokens_computed == len(PROMPTS) * (MAX_TOKENS - 1)
    dep.assert_no_leaks()


def test_decode_reports_loaded_blocks_and_its_own_hits_reduce_them(
    single: list[list[int]],
) -> None:
    dep = Deployment()
    first = dep.prefill_all(PROMPTS[:1])[0]
    dep.decode.add_request(
        PROMPTS[0] + [first.output_token_ids[0]], 4, kv_transfer_params=first.kv_transfer_params
    )
    out = run_to_end(dep.decode)
    (cold,) = out.values()
    assert (cold.blocks_local_hit, cold.blocks_loaded, cold.blocks_recomputed) == (0, 3, 0)
    assert cold.ttft_s is not None
    # the same prompt again: decode's own cache holds the two whole loaded blocks
    second = dep.prefill_all(PROMPTS[:1])[0]
    rid = dep.decode.add_request(
        PROMPTS[0] + [second.output_token_ids[0]],
        MAX_TOKENS - 1,
        kv_transfer_params=second.kv_transfer_params,
    )
    warm = run_to_end(dep.decode)[rid]
    assert (warm.blocks_local_hit, warm.blocks_loaded, warm.blocks_recomputed) == (2, 1, 0)
    assert [second.output_token_ids[0], *warm.output_token_ids] == single[0]
    dep.assert_no_leaks()


def test_prefill_keeps_blocks_until_decode_has_read_them() -> None:
    dep = Deployment()
    (first,) = dep.prefill_all(PROMPTS[:1])
    held = dep.prefill.num_free_blocks()
    assert held == dep.prefill.pools["self"].num_blocks - 3
    for _ in range(3):
        dep.prefill.step()
    assert dep.prefill.num_free_blocks() == held  # nobody has read them yet
    dep.wire.released.add(first.request_id)
    dep.prefill.step()
    assert_all_blocks_free(dep.prefill)


@pytest.mark.parametrize("is_async", [True, False])
def test_a_failed_block_load_is_recomputed_from_that_block_and_output_still_matches(
    single: list[list[int]], is_async: bool
) -> None:
    dep = Deployment(fail_index=1, is_async=is_async)
    tokens, outs = pd(dep, PROMPTS[:3], MAX_TOKENS)
    assert tokens == single[:3]
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        blocks = -(-len(prompt) // BLOCK)
        assert (out.blocks_loaded, out.blocks_recomputed) == (1, blocks - 1)
        # every token from block 1 on (prompt + first token) went through the model
        assert out.num_computed_tokens == len(prompt) + 1 - BLOCK + MAX_TOKENS - 2
    dep.assert_no_leaks()


def test_an_aborted_load_keeps_its_blocks_until_the_load_is_done() -> None:
    dep = Deployment(delay=1)
    first = dep.prefill_all(PROMPTS[:1])[0]
    rid = dep.decode.add_request(
        PROMPTS[0] + [first.output_token_ids[0]], 4, kv_transfer_params=first.kv_transfer_params
    )
    dep.decode.step()
    assert dep.decode.scheduler._running[0].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    out = dep.decode.abort(rid)
    assert out is not None and out.finish_reason == "abort"
    assert dep.decode_scheduler.finished == [rid]
    assert dep.decode.num_free_blocks() < dep.decode.pools["self"].num_blocks
    assert dep.decode.has_held_blocks()
    dep.decode.step()  # the load reports done: now the blocks can be reused
    dep.assert_no_leaks()


def test_worker_hooks_run_in_vllm_order() -> None:
    dep = Deployment()
    pd(dep, PROMPTS[:1], 3)
    calls = dep.decode_worker.calls
    step = ["start_load_kv", "wait_for_save", "get_finished", "get_block_ids_with_load_errors"]
    assert calls[: len(step)] == step
    assert len(calls) % len(step) == 0


def test_aborting_a_waiting_request_tells_the_connector() -> None:
    dep = Deployment()
    (first,) = dep.prefill_all(PROMPTS[:1])
    rid = dep.decode.add_request(
        [*PROMPTS[0], first.output_token_ids[0]], 4, kv_transfer_params=first.kv_transfer_params
    )
    out = dep.decode.abort(rid)
    assert out is not None and out.finish_reason == "abort"
    assert dep.decode_scheduler.finished == [rid]
    dep.wire.released.add(first.request_id)  # what a real decode connector would do
    dep.assert_no_leaks()

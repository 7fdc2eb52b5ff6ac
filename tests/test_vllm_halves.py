"""The vLLM connector's halves without vLLM: load plans with the offload daemon, store orders,
and when a finished request's blocks go back to vLLM.

``VllmScheduler`` and ``VllmWorker`` import no vLLM; these tests drive them the
way ``kvbridge.connector.vllm`` does, with a hand-written daemon lookup, so the
planning rules are pinned down in the main environment (the end-to-end
behaviour inside real vLLM is in ``test_vllm_offload.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvbridge.connector import KVTransferParams
from kvbridge.connector.base import BlockLoad, BlockStore, LoadResult, StepMetadata
from kvbridge.connector.control import LeaseTable
from kvbridge.connector.offload import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.scheduler import HoldOrder, VllmScheduler, kv_tokens, to_json_params
from kvbridge.connector.vllm.worker import RESULTS_KEPT, HeldRequests, VllmWorker, WorkerSettings
from kvbridge.proto import BlockHash, BlockId, ConfigError, LeaseId, RequestId

BS = 4
PROMPT = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 tokens
RID = RequestId("r1")


class FakeDaemon:
    """Holds a set of block names; answers lookups like the daemon (leading hits)."""

    def __init__(self, held: Sequence[BlockHash] = ()) -> None:
        self.held = set(held)
        self.asked: list[list[BlockHash]] = []

    def __call__(self, hashes: Sequence[BlockHash]) -> int:
        self.asked.append(list(hashes))
        n = 0
        while n < len(hashes) and hashes[n] in self.held:
            n += 1
        return n


def _config(role: str, **extra: object) -> VllmConnectorConfig:
    extra = {"control_port": 7600, **extra} if role != "kv_consumer" else extra
    return VllmConnectorConfig.from_vllm(role, "engine-a", extra, model="tiny")


def _scheduler(role: str = "kv_both", daemon: FakeDaemon | None = None) -> VllmScheduler:
    cfg = _config(role, offload_address="127.0.0.1:50060")
    hasher = cfg.hasher(dtype="float32", num_layers=2, num_kv_heads=1, head_size=8, block_size=BS)
    return VllmScheduler(cfg.connector, BS, hasher, daemon)


def _names(sched: VllmScheduler, tokens: Sequence[int]) -> list[BlockHash]:
    return sched.hasher.hash_blocks(list(tokens))


def _only_load(sched: VllmScheduler) -> BlockLoad:
    step, _ = sched.build_step()
    assert len(step.loads) == 1, step
    return step.loads[0]


def test_offload_hits_after_the_local_prefix_load_from_the_daemon_alone() -> None:
    sched = _scheduler()
    names = _names(sched, PROMPT)
    daemon = FakeDaemon(names[:3])  # the daemon holds blocks 0..2
    sched.offload_lookup = daemon
    # vLLM's own cache holds block 0: the daemon is asked from block 1 on
    assert sched.num_matched(RID, PROMPT, None, num_computed_tokens=BS) == (2 * BS, True)
    assert daemon.asked == [names[1:4]]  # block 4 is partial; 4 full blocks, 1 local
    sched.after_alloc(RID, PROMPT, [BlockId(b) for b in (10, 11, 12, 13, 14)], 2 * BS)
    load = _only_load(sched)
    assert load.remote_engine == "" and load.remote_ids == {}
    assert load.local_ids == {"self": (11, 12)}
    assert load.offload_hashes == tuple(names[1:3])


def test_the_last_prompt_token_is_never_loaded_from_the_daemon() -> None:
    sched = _scheduler()
    prompt = PROMPT[:16]  # exactly 4 full blocks
    daemon = FakeDaemon(_names(sched, prompt))
    sched.offload_lookup = daemon
    assert sched.num_matched(RID, prompt, None, 0) == (3 * BS, True)
    assert len(daemon.asked[0]) == 3  # the 4th block holds the token vLLM must compute


def test_no_daemon_hits_or_no_daemon_means_no_load() -> None:
    sched = _scheduler(daemon=FakeDaemon())
    assert sched.num_matched(RID, PROMPT, None, 0) == (0, False)
    plain = _scheduler(daemon=None)
    assert plain.num_matched(RID, PROMPT, None, 0) == (0, False)
    assert sched.build_step()[0].loads == () and plain.build_step()[0].loads == ()


def _prefill_params(sched: VllmScheduler, prompt: Sequence[int]) -> dict[str, object]:
    names = _names(sched, prompt)
    n = -(-len(prompt) // BS)
    params = KVTransferParams(
        remote_engine_id="prefill-0",  # type: ignore[arg-type]
        remote_address="10.0.0.1:7600",
        request_id=RID,
        num_tokens=len(prompt),
        block_ids={"self": tuple(BlockId(100 + i) for i in range(n))},
        block_hashes={"self": tuple(names)},
        lease_id=LeaseId("lease-1"),
        lease_ttl_s=30.0,
    )
    return to_json_params(params.to_dict())


def test_decode_plans_the_daemons_blocks_first_and_the_rest_from_prefill() -> None:
    sched = _scheduler(role="kv_consumer")
    names = _names(sched, PROMPT)
    sched.offload_lookup = FakeDaemon(names[:2])
    raw = _prefill_params(sched, PROMPT)
    # no local hit: every prompt token is external
    assert sched.num_matched(RID, PROMPT, raw, 0) == (len(PROMPT), True)
    sched.after_alloc(RID, PROMPT, [BlockId(b) for b in range(5)], len(PROMPT))
    load = _only_load(sched)
    assert load.offload_hashes == tuple(names[:2])
    assert load.local_ids == {"self": (0, 1, 2, 3, 4)}
    assert load.remote_ids == {"self": (100, 101, 102, 103, 104)}
    assert load.remote_engine == "prefill-0" and load.lease_id == "lease-1"


def test_a_request_handed_over_to_decode_keeps_its_blocks_until_the_worker_says_done() -> None:
    prefill = _scheduler(role="kv_producer")
    prefill.offload_lookup = None  # no store: the hold alone must keep the blocks
    ids = [BlockId(b) for b in range(5)]
    delay_free, params = prefill.request_finished(
        RID, PROMPT, {"do_remote_decode": True}, ids, True
    )
    # vLLM frees the blocks at once unless told to wait for done_sending (the lease's end)
    assert params is not None and delay_free is True
    assert [o.request_id for o in prefill.build_step()[1]] == [RID]


def test_a_decodes_load_names_its_blocks_as_the_prefill_leased_them() -> None:
    prefill = _scheduler(role="kv_producer")
    ids = [BlockId(b) for b in (20, 21, 22, 23, 24)]
    _, params = prefill.request_finished(RID, PROMPT, {"do_remote_decode": True}, ids, True)
    _, (order,) = prefill.build_step()
    assert params is not None and len(order.block_hashes) == 5  # 4 full blocks and the tail
    decode = _scheduler(role="kv_consumer")
    decode.offload_lookup = None
    rid = RequestId("d1")
    assert decode.num_matched(rid, PROMPT, params, 0) == (len(PROMPT), True)
    decode.after_alloc(rid, PROMPT, [BlockId(b) for b in range(5)], len(PROMPT))
    load = _only_load(decode)
    # the owner answers with the names it leased; a load asking for others is refused
    assert tuple(load.remote_hashes["self"]) == order.block_hashes
    assert load.seal and load.remote_request_id == RID


def test_a_failed_load_is_not_offered_twice() -> None:
    sched = _scheduler()
    sched.offload_lookup = FakeDaemon(_names(sched, PROMPT))
    assert sched.num_matched(RID, PROMPT, None, 0)[0] > 0
    sched.after_alloc(RID, PROMPT, [BlockId(b) for b in range(5)], 4 * BS)
    # vLLM asks again after the load reported errors: recompute, never a second load
    assert sched.num_matched(RID, PROMPT, None, 0) == (0, False)


def test_a_finished_request_orders_a_store_of_its_full_prompt_blocks() -> None:
    sched = _scheduler(daemon=FakeDaemon())
    ids = [BlockId(b) for b in (7, 8, 9, 10, 11)]
    assert sched.request_finished(RID, PROMPT, None, ids, prompt_done=True) == (True, None)
    step, holds = sched.build_step()
    assert holds == ()
    (store,) = step.stores
    assert store.block_ids == (7, 8, 9, 10)  # the partial 5th block is never stored
    assert store.hashes == tuple(_names(sched, PROMPT))


def test_a_finished_request_stores_the_full_blocks_its_generated_tokens_completed() -> None:
    sched = _scheduler(daemon=FakeDaemon())
    ids = [BlockId(b) for b in (7, 8, 9, 10, 11, 12)]
    computed = [*PROMPT, 40, 41, 42, 43]  # 22 tokens with KV: 5 full blocks and 2 tokens
    delay, params = sched.request_finished(
        RID, PROMPT, {"do_remote_decode": True}, ids, prompt_done=True, computed=computed
    )
    assert delay and params is not None
    step, _ = sched.build_step()
    (store,) = step.stores
    assert store.block_ids == (7, 8, 9, 10, 11)  # the 5th block was completed by decode
    assert store.hashes == tuple(_names(sched, computed))
    # the hand-over still names the prompt's blocks only (the same chain's first 4)
    assert params["block_hashes"]["self"] == [h.hex() for h in _names(sched, PROMPT)]
    assert params["num_tokens"] == len(PROMPT)


def test_the_last_generated_token_has_no_kv_and_never_more_than_vllm_computed() -> None:
    tokens = [*PROMPT, 40, 41, 42]
    assert kv_tokens(tokens, len(tokens)) == tokens[:-1]  # the last one was sampled only
    assert kv_tokens(tokens, len(PROMPT)) == PROMPT
    assert kv_tokens([], 0) == []


def test_computed_tokens_that_do_not_extend_the_prompt_store_only_the_prompt() -> None:
    sched = _scheduler(daemon=FakeDaemon())
    ids = [BlockId(b) for b in (7, 8, 9, 10, 11, 12)]
    other = [99, *PROMPT[1:], 40, 41, 42, 43]
    sched.request_finished(RID, PROMPT, None, ids, prompt_done=True, computed=other)
    (store,) = sched.build_step()[0].stores
    assert store.hashes == tuple(_names(sched, PROMPT))


def test_an_aborted_request_stores_nothing_hands_nothing_over_and_frees_at_once() -> None:
    sched = _scheduler(daemon=FakeDaemon())
    ids = [BlockId(b) for b in range(5)]
    raw = {"do_remote_decode": True}
    assert sched.request_finished(RID, PROMPT, raw, ids, prompt_done=False) == (False, None)
    step, holds = sched.build_step()
    assert step.stores == () and holds == ()


def test_prefill_with_offload_holds_and_stores_the_same_request() -> None:
    sched = _scheduler(daemon=FakeDaemon())
    ids = [BlockId(b) for b in range(5)]
    delay, params = sched.request_finished(
        RID, PROMPT, {"do_remote_decode": True}, ids, prompt_done=True
    )
    assert delay and params is not None and params["remote_engine_id"] == "engine-a"
    step, holds = sched.build_step()
    assert [h.request_id for h in holds] == [RID] and holds[0].block_ids == tuple(ids)
    assert [s.request_id for s in step.stores] == [RID]


def test_without_a_daemon_a_plain_request_is_freed_at_once() -> None:
    sched = _scheduler(daemon=None)
    assert sched.request_finished(RID, PROMPT, None, [BlockId(0)] * 5, True) == (False, None)


class FakeLoader:
    """Stands in for KVBridgeWorker: records what it was asked to start; stores end on cue."""

    def __init__(self) -> None:
        self.started: list[StepMetadata] = []
        self.stored: set[RequestId] = set()

    def start_load_kv(self, step: StepMetadata) -> None:
        self.started.append(step)

    def get_finished(self, _: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        done, self.stored = self.stored, set()
        return done, set()

    def pop_result(self, request_id: RequestId) -> None:
        return None


def _producer_worker() -> tuple[VllmWorker, FakeLoader]:
    cfg = _config("kv_both", offload_address="127.0.0.1:50060")
    worker = VllmWorker(cfg.connector, WorkerSettings(model_name="tiny", block_size=BS))
    loader = FakeLoader()
    worker.loader = loader  # type: ignore[assignment]
    worker.held = HeldRequests({"self": 16})
    worker.leases = LeaseTable(worker.held)
    return worker, loader


def test_a_request_held_and_stored_is_done_sending_once_both_are_over() -> None:
    worker, loader = _producer_worker()
    ids = (BlockId(0), BlockId(1))
    names = (BlockHash(b"a" * 32), BlockHash(b"b" * 32))
    order = HoldOrder(RID, LeaseId("lease-1"), ids, names, 30.0)
    worker.start_step(StepMetadata(stores=(BlockStore(RID, ids, names),)), [order])
    assert [s.stores for s in loader.started] == [(BlockStore(RID, ids, names),)]
    assert worker.get_finished() == (set(), set())
    loader.stored.add(RID)  # the store is over, the decode peer still reads
    assert worker.get_finished() == (set(), set())
    assert worker.leases is not None and worker.leases.release(LeaseId("lease-1"))
    assert worker.get_finished() == ({RID}, set())  # once, when both are over
    assert worker.get_finished() == (set(), set())
    assert worker.pending_sends == 0


def test_a_stored_request_without_a_decode_peer_is_done_when_the_store_is() -> None:
    worker, loader = _producer_worker()
    store = BlockStore(RID, (BlockId(3),), (BlockHash(b"c" * 32),))
    worker.start_step(StepMetadata(stores=(store,)), [])
    assert worker.pending_sends == 1
    loader.stored.add(RID)
    assert worker.get_finished() == ({RID}, set())
    assert worker.pending_sends == 0


def test_offload_address_must_be_host_and_port() -> None:
    with pytest.raises(ConfigError, match=r"offload_address must be host:port"):
        _config("kv_consumer", offload_address="nodaemon")
    assert _config("kv_consumer").connector.offload_address == ""


def test_an_unreachable_daemon_is_a_quick_miss_then_not_asked_again() -> None:
    lookup = OffloadLookup(OffloadLookupConfig("127.0.0.1:9", timeout_s=0.5, backoff_s=60))
    try:
        assert lookup([BlockHash(b"a" * 32)]) == 0
        retry_at = lookup._retry_at
        assert retry_at > 0
        assert lookup([BlockHash(b"a" * 32)]) == 0
        assert lookup._retry_at == retry_at  # inside the backoff: no second call
    finally:
        lookup.close()


class ReportingLoader(FakeLoader):
    """A loader whose loads all finish at once, each with a load report."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: set[RequestId] = set()

    def get_finished(self, _: set[RequestId]) -> tuple[set[RequestId], set[RequestId]]:
        done, self.finished = self.finished, set()
        return set(), done

    def pop_result(self, request_id: RequestId) -> LoadResult:  # type: ignore[override]
        return LoadResult(request_id, 1, 1, (), 0.5)


def test_load_reports_kept_by_a_long_running_worker_stay_bounded_newest_kept() -> None:
    worker, _ = _producer_worker()
    loader = ReportingLoader()
    worker.loader = loader  # type: ignore[assignment]
    total = RESULTS_KEPT + 500
    for i in range(total):
        loader.finished.add(RequestId(f"r{i}"))
        assert worker.get_finished() == (set(), {RequestId(f"r{i}")})
    assert len(worker.results) == RESULTS_KEPT
    newest = [RequestId(f"r{i}") for i in range(total - RESULTS_KEPT, total)]
    assert list(worker.results) == newest
    assert worker.results[newest[-1]].blocks_moved == 1


def test_offload_verify_is_on_by_default_and_must_be_a_boolean() -> None:
    assert _config("kv_consumer", offload_address="127.0.0.1:50060").connector.offload_verify
    off = _config("kv_consumer", offload_address="127.0.0.1:50060", offload_verify=False)
    assert off.connector.offload_verify is False
    with pytest.raises(ConfigError, match="offload_verify must be true or false"):
        _config("kv_consumer", offload_verify="no")

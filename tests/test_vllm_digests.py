"""Verified loads from a vLLM prefill, without vLLM: the key goes with the hold order, the
worker digests the held blocks when it makes the lease, and a reader asks the worker's
control server for them (``Digests``, real gRPC on loopback).

The end-to-end check inside real vLLM (a token holder's junk recomputed, not decoded) is in
``test_vllm_pd.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from kvbridge.connector import BlockLoad, KVTransferParams, StepMetadata
from kvbridge.connector.control import ControlClient, LeaseTable, PeerInfo, Role
from kvbridge.connector.control.leases import HandOverDigests
from kvbridge.connector.control.server import DIGESTS_WAIT_S, ControlServerConfig, serve
from kvbridge.connector.load.verify import Expected
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.scheduler import HoldOrder, VllmScheduler, from_json_params
from kvbridge.connector.vllm.worker import HeldRequests, VllmWorker, WorkerSettings
from kvbridge.kernels import ALGO_DEVICE, ALGO_XXH3, block_digests, new_key
from kvbridge.proto import (
    BlockId,
    ControlPlaneError,
    EngineId,
    LeaseError,
    LeaseId,
    RequestId,
    WireError,
    preset_layout,
)

BS = 4
PROMPT = list(range(1, 19))  # 18 tokens: 5 blocks of 4
RID = RequestId("r1")


def _scheduler(role: str, **extra: Any) -> VllmScheduler:
    extra = {"control_port": 7600, **extra} if role != "kv_consumer" else extra
    cfg = VllmConnectorConfig.from_vllm(role, "engine-a", extra, model="tiny")
    hasher = cfg.hasher(dtype="float32", num_layers=2, num_kv_heads=1, head_size=8, block_size=BS)
    return VllmScheduler(cfg.connector, BS, hasher)


def _hand_over(**extra: Any) -> tuple[dict[str, Any] | None, HoldOrder]:
    prefill = _scheduler("kv_producer", **extra)
    ids = [BlockId(b) for b in (20, 21, 22, 23, 24)]
    _, params = prefill.request_finished(RID, PROMPT, {"do_remote_decode": True}, ids, True)
    _, (order,) = prefill.build_step()
    return params, order


def test_the_key_goes_with_the_hold_order_and_the_params_say_the_owner_keeps_digests() -> None:
    params, order = _hand_over()
    assert params is not None and order.digest_key is not None
    assert params["digest_key"] == order.digest_key
    assert params["digests_at_owner"] is True and "digests" not in params
    parsed = KVTransferParams.parse(from_json_params(params) or {}, BS)
    assert parsed.digests_at_owner and parsed.digests == {}
    # the decode's load asks the owner for them, under the same key
    decode = _scheduler("kv_consumer")
    rid = RequestId("d1")
    assert decode.num_matched(rid, PROMPT, params, 0)[0] == len(PROMPT)
    decode.after_alloc(rid, PROMPT, [BlockId(b) for b in range(5)], len(PROMPT))
    (load,) = decode.build_step()[0].loads
    assert load.digests_at_owner and load.digest_key == order.digest_key
    assert not any(load.digests.values())


def test_with_verification_off_no_key_is_drawn_and_none_is_sent() -> None:
    params, order = _hand_over(verify_loads=False)
    assert params is not None and "digest_key" not in params and order.digest_key is None


def test_params_refuse_an_unknown_algorithm_and_a_non_boolean_owner_flag() -> None:
    params, _ = _hand_over()
    raw = from_json_params(params) or {}
    assert KVTransferParams.parse(raw, BS).digest_algo == ALGO_XXH3
    assert KVTransferParams.parse({**raw, "digest_algo": ALGO_DEVICE}, BS).digest_algo == (
        ALGO_DEVICE
    )
    with pytest.raises(WireError, match="digest_algo"):
        KVTransferParams.parse({**raw, "digest_algo": "md5"}, BS)
    with pytest.raises(WireError, match="digests_at_owner"):
        KVTransferParams.parse({**raw, "digests_at_owner": "yes"}, BS)


def _worker() -> tuple[VllmWorker, dict[str, torch.Tensor]]:
    cfg = VllmConnectorConfig.from_vllm(
        "kv_producer", "engine-a", {"control_port": 7600}, model="tiny"
    )
    worker = VllmWorker(cfg.connector, WorkerSettings(model_name="tiny", block_size=16))
    layout = preset_layout("tiny", num_blocks=32, order="layer-nhd")
    caches = layout.allocate()
    gen = torch.Generator().manual_seed(3)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    worker.layout = layout.bind(caches)
    worker.held = HeldRequests({"self": 32})
    worker.leases = LeaseTable(worker.held)
    return worker, caches


def _order(key: int | None, lease: str = "ab" * 16) -> HoldOrder:
    hashes = tuple(bytes([i]) * 32 for i in range(3))
    return HoldOrder(RID, LeaseId(lease), (BlockId(4), BlockId(9), BlockId(2)), hashes, 30.0, key)  # type: ignore[arg-type]


def test_the_worker_digests_the_held_blocks_when_it_makes_the_lease() -> None:
    worker, _ = _worker()
    key = new_key()
    worker.start_step(_empty_step(), [_order(key)])
    assert worker.leases is not None and worker.layout is not None
    got = worker.leases.digests(LeaseId("ab" * 16))
    assert got is not None and got.algo == ALGO_XXH3
    assert list(got.groups["self"]) == block_digests(worker.layout, "self", [4, 9, 2], key)
    # released: the digests go with the lease
    assert worker.leases.release(LeaseId("ab" * 16))
    worker.get_finished()
    assert worker.leases.digests(LeaseId("ab" * 16)) is None


def test_an_order_without_a_key_records_no_digests() -> None:
    worker, _ = _worker()
    worker.start_step(_empty_step(), [_order(None)])
    assert worker.leases is not None and worker.leases.digests(LeaseId("ab" * 16)) is None


def _empty_step() -> StepMetadata:
    return StepMetadata(loads=(), stores=())


def test_the_digests_rpc_answers_a_reader_and_waits_for_a_late_hold_order() -> None:
    worker, _ = _worker()
    assert worker.leases is not None and worker.layout is not None
    info = PeerInfo(EngineId("engine-a"), Role.PREFILL, preset_layout("tiny", num_blocks=32))
    key = new_key()
    server = serve(info, worker.leases, ControlServerConfig())
    with server, ControlClient(server.address) as client:
        # the hold order reaches the worker while the reader already waits for it
        late = threading.Timer(0.1, worker.start_step, (_empty_step(), [_order(key)]))
        late.start()
        got = client.digests(LeaseId("ab" * 16), timeout_s=5)
        late.join()
        want = block_digests(worker.layout, "self", [4, 9, 2], key)
        assert got.algo == ALGO_XXH3 and list(got.groups["self"]) == want
        # an unknown lease: NOT_FOUND after the bounded wait, never a hang
        t0 = time.monotonic()
        with pytest.raises(LeaseError):
            client.digests(LeaseId("cd" * 16), timeout_s=5)
        assert time.monotonic() - t0 >= DIGESTS_WAIT_S * 0.9
        with pytest.raises(ControlPlaneError) as bad:
            client.digests(LeaseId("not-a-lease"), timeout_s=5)
        assert bad.value.code == "INVALID_ARGUMENT"


def _load(key: int) -> BlockLoad:
    return BlockLoad(
        RID,
        "e",
        "a",
        {"self": (0, 1, 2)},
        {"self": (0, 1, 2)},
        lease_id="ab" * 16,
        first_block=1,
        digest_key=key,
        digests_at_owner=True,
    )


def test_fetched_digests_are_checked_from_the_loads_first_block_with_the_owners_algo() -> None:
    layout = preset_layout("tiny", num_blocks=8, order="layer-nhd")
    caches = layout.allocate()
    for i, t in enumerate(caches.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape).to(t.dtype) + i)
    bound = layout.bind(caches)
    key = new_key()
    owner = block_digests(bound, "self", [7, 0, 1, 2], key, ALGO_DEVICE)  # lease: 7, 0, 1, 2
    pending: Future[HandOverDigests] = Future()
    expected = Expected.fetching(_load(key), pending)
    pending.set_result(HandOverDigests(ALGO_DEVICE, {"self": tuple(owner)}))
    assert expected.check(bound, "self", [0, 1, 2]) == (3, 0)
    # the same bytes under XXH3 do not match the owner's device digests
    wrong: Future[HandOverDigests] = Future()
    wrong.set_result(HandOverDigests(ALGO_XXH3, {"self": tuple(owner)}))
    assert Expected.fetching(_load(key), wrong).check(bound, "self", [0, 1, 2]).good == 0
    # a fetch that failed fails the load (the caller recomputes every block)
    failed: Future[HandOverDigests] = Future()
    failed.set_exception(LeaseError("no digests recorded"))
    with pytest.raises(LeaseError):
        Expected.fetching(_load(key), failed).check(bound, "self", [0, 1, 2])


def test_params_name_the_issuers_algorithm_and_a_reader_computes_that_one() -> None:
    from kvbridge.connector.planner import KVBridgePlanner, LeaseIssuer

    layout = preset_layout("tiny", num_blocks=8, order="layer-nhd")
    caches = layout.allocate()
    for i, t in enumerate(caches.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape).to(t.dtype) - i)
    bound = layout.bind(caches)

    class DeviceIssuer(LeaseIssuer):
        """An owner whose KV is on a GPU: digests with the device algorithm (its CPU
        reference here, as a reader on the host computes it)."""

        def verified_prefix(self, group: str, block_ids: Any, hashes: Any) -> int:
            return len(block_ids)

        def lease_request(self, request_id: Any, blocks: Any, hashes: Any) -> Any:
            return LeaseId("ef" * 16), 30.0

        def digest_algo(self) -> str:
            return ALGO_DEVICE

        def digests(self, blocks: Any, key: int) -> dict[str, list[bytes]]:
            return {
                g: block_digests(bound, g, list(ids), key, ALGO_DEVICE) for g, ids in blocks.items()
            }

    cfg = VllmConnectorConfig.from_vllm("kv_producer", "e", {"control_port": 7600}, model="tiny")
    planner = KVBridgePlanner(cfg.connector, layout.block_size)
    planner.attach(DeviceIssuer(), None)
    sched = _scheduler("kv_producer")
    prompt = list(range(1, 3 * layout.block_size))
    view = sched._view(RID, prompt, {"do_remote_decode": True})
    _, params = planner.request_finished(view, {"self": [BlockId(b) for b in (5, 6, 7)]})
    assert params is not None and params["digest_algo"] == ALGO_DEVICE
    parsed = KVTransferParams.parse(params, layout.block_size)
    load = BlockLoad(
        RID,
        "e",
        "a",
        {"self": (5, 6, 7)},
        {"self": (5, 6, 7)},
        digest_key=parsed.digest_key,
        digests=parsed.digests,
        digest_algo=parsed.digest_algo,
    )
    expected = Expected.of(load)
    assert expected is not None and expected.check(bound, "self", [5, 6, 7]) == (3, 0)
    # a reader that computed its own default (XXH3 on CPU memory) would mismatch every block
    xxh3 = Expected(parsed.digest_key or 0, parsed.digests, ALGO_XXH3)
    assert xxh3.check(bound, "self", [5, 6, 7]) == (0, 3)


def test_a_worker_with_head_major_pages_records_and_serves_head_digests() -> None:
    """Pages a reader of a bigger TP size reads in head slices are digested head by head at
    hand-over too, and the ``Digests`` reply carries them (real gRPC on loopback)."""
    import dataclasses

    from kvbridge.kernels import page_slice_digests
    from kvbridge.proto.negotiate import HEAD_MAJOR_SUFFIX

    worker, _ = _worker()
    assert worker.layout is not None
    model = worker.layout.model
    worker.layout = dataclasses.replace(
        worker.layout,
        model=dataclasses.replace(model, name=model.name + HEAD_MAJOR_SUFFIX, num_kv_heads=2),
    )
    key = new_key()
    worker.start_step(_empty_step(), [_order(key)])
    assert worker.leases is not None
    got = worker.leases.digests(LeaseId("ab" * 16))
    per_head = page_slice_digests(worker.layout, "self", [4, 9, 2], key, 2)
    assert got is not None and got.heads == 2
    assert list(got.head_groups["self"]) == [d for block in per_head for d in block]
    info = PeerInfo(EngineId("engine-a"), Role.PREFILL, preset_layout("tiny", num_blocks=32))
    server = serve(info, worker.leases, ControlServerConfig())
    with server, ControlClient(server.address) as client:
        served = client.digests(LeaseId("ab" * 16), timeout_s=5)
    assert served == got

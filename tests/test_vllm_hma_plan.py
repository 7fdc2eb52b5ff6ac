"""A hybrid model's KV cache groups in the vLLM connector's halves, without vLLM: which
blocks of each group a prefill hands over and a decode loads, under which names, and which
group kinds are refused at startup.

vLLM's hybrid KV cache manager (kept on: ``SupportsHMA``) gives the connector one block
table per KV cache group. kvbridge's ``self`` group is the full-attention group; the others
(``g<i>``) move only the blocks the decode's next tokens attend to. The end-to-end runs
inside real vLLM are ``test_vllm_hybrid.py`` and ``test_vllm_kv_sharing.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbridge.connector import KVTransferParams
from kvbridge.connector.control.seal import seal_digest
from kvbridge.connector.handover import group_name
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.kinds import (
    GroupKind,
    group_pages,
    layer_groups,
    plan_groups,
    vllm_group_kinds,
    vllm_groups,
)
from kvbridge.connector.vllm.scheduler import VllmScheduler, from_json_params
from kvbridge.proto import (
    BlockId,
    ConfigError,
    KVLayout,
    LayoutError,
    RequestId,
    WireError,
)
from kvbridge.proto.layout import PageShape

BS = 4
WINDOW = 6  # tokens: after 18 tokens vLLM keeps tokens 13.. of the window (blocks 3 and 4)
PROMPT = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 tokens
RID = RequestId("r1")
SHAPE = (2, 8, "float32", BS)
GROUPS = ("g0", "self")  # vLLM's group 0 is the sliding one here, group 1 the full one
FULL = [BlockId(b) for b in (20, 21, 22, 23, 24)]
SLIDING = [BlockId(b) for b in (0, 0, 30, 31, 32)]  # vLLM freed blocks 0 and 1 (null block)


def _scheduler(role: str, window: int | None = WINDOW, **extra: Any) -> VllmScheduler:
    extra = {"control_port": 7600, **extra} if role != "kv_consumer" else extra
    cfg = VllmConnectorConfig.from_vllm(role, "engine-a", extra, model="tiny")
    hasher = cfg.hasher(dtype="float32", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS)
    return VllmScheduler(cfg.connector, BS, hasher, groups=GROUPS, windows={"g0": window})


def _hand_over(sliding: list[BlockId] = SLIDING, window: int | None = WINDOW) -> Any:
    prefill = _scheduler("kv_producer", window)
    _, params = prefill.request_finished(
        RID, PROMPT, {"do_remote_decode": True}, (sliding, FULL), True
    )
    _, orders = prefill.build_step()
    return params, orders


def _names(sched: VllmScheduler, group: str, first: int, end: int = 5) -> tuple[bytes, ...]:
    full = sched.hasher.hash_blocks(PROMPT)
    names = (*full, sched.planner._names(_view(sched), len(PROMPT))[-1])
    return tuple(group_name(group, n) for n in names[first:end])


def _view(sched: VllmScheduler) -> Any:
    return sched._view(RID, PROMPT, None)


def test_prefill_hands_over_the_sliding_groups_in_window_blocks_only() -> None:
    params, (order,) = _hand_over()
    parsed = KVTransferParams.parse(from_json_params(params) or {}, BS)
    assert parsed.block_ids == {"self": tuple(FULL), "g0": (31, 32)}
    decode = _scheduler("kv_consumer")
    assert parsed.block_hashes["g0"] == _names(decode, "g0", 3)
    # the worker holds, leases and digests both groups
    assert order.blocks() == {"self": tuple(FULL), "g0": (31, 32)}
    assert order.hashes()["g0"] == parsed.block_hashes["g0"]


def test_decode_loads_each_groups_blocks_and_its_seal_is_the_leases() -> None:
    params, (order,) = _hand_over()
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (len(PROMPT), True)
    local_sliding = [BlockId(b) for b in (0, 0, 0, 41, 42)]
    local_full = [BlockId(b) for b in (50, 51, 52, 53, 54)]
    decode.after_alloc(RID, PROMPT, (local_sliding, local_full), len(PROMPT))
    (load,) = decode.build_step()[0].loads
    assert load.local_ids == {"self": tuple(local_full), "g0": (41, 42)}
    assert load.remote_ids == {"self": tuple(FULL), "g0": (31, 32)}
    assert load.remote_hashes["g0"] == _names(decode, "g0", 3)
    assert load.lease_offset("g0") == 0 and load.lease_offset("self") == 0
    # the seal decode expects is the one the prefill's lease publishes
    assert load.seal == seal_digest(order.blocks(), order.hashes())


def test_a_local_prefix_hit_inside_the_window_loads_the_rest_at_its_lease_offset() -> None:
    params, _ = _hand_over()
    decode = _scheduler("kv_consumer")
    # vLLM's own cache holds 4 blocks of each group (16 tokens)
    assert decode.num_matched(RID, PROMPT, params, 4 * BS) == (2, True)
    decode.after_alloc(RID, PROMPT, ([0, 0, 0, 41, 42], [50, 51, 52, 53, 54]), 2)
    (load,) = decode.build_step()[0].loads
    assert load.local_ids == {"self": (54,), "g0": (42,)}
    assert load.remote_ids == {"self": (24,), "g0": (32,)}
    assert load.remote_hashes["g0"] == _names(decode, "g0", 4)
    assert load.lease_offset("g0") == 1 and load.lease_offset("self") == 4


def test_a_prefill_with_a_narrower_window_than_decodes_is_recomputed() -> None:
    params, _ = _hand_over(window=2)  # hands over block 4 only
    decode = _scheduler("kv_consumer")  # its window reaches back to block 3
    assert decode.num_matched(RID, PROMPT, params, 0) == (0, False)
    assert "g0" in decode.planner.refused[RID][0]


def test_group_names_of_another_prompt_are_refused() -> None:
    params, _ = _hand_over()
    params["block_hashes"]["g0"] = params["block_hashes"]["g0"][::-1]
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (0, False)
    assert "g0" in decode.planner.refused[RID][0]


def test_a_group_without_a_window_is_handed_over_whole() -> None:
    params, _ = _hand_over(sliding=[BlockId(b) for b in (30, 31, 32, 33, 34)], window=None)
    assert params["block_ids"]["g0"] == [30, 31, 32, 33, 34]


def test_vllms_null_block_is_never_handed_over() -> None:
    # a null block inside the window: no hand-over at all (decode recomputes)
    for sliding in ((0, 0, 0, 31, 32), (0, 0, 30, 0, 32)):
        none, orders = _hand_over(sliding=[BlockId(b) for b in sliding], window=10)
        assert none is None and orders == (), sliding


def test_decode_never_loads_into_its_null_block() -> None:
    params, _ = _hand_over()
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (len(PROMPT), True)
    decode.after_alloc(RID, PROMPT, ([0, 0, 0, 0, 42], [50, 51, 52, 53, 54]), len(PROMPT))
    (load,) = decode.build_step()[0].loads
    assert load.local_ids["g0"] == (42,) and load.remote_ids["g0"] == (32,)
    assert load.lease_offset("g0") == 1


def test_params_of_an_unknown_group_or_too_many_blocks_are_refused() -> None:
    params, _ = _hand_over()
    raw = from_json_params(params) or {}
    bad = {**raw, "block_ids": {**raw["block_ids"], "g0": [1] * 6}}
    bad["block_hashes"] = {**raw["block_hashes"], "g0": [b"x" * 32] * 6}
    with pytest.raises(WireError, match="'g0' lists 6 blocks"):
        KVTransferParams.parse(bad, BS)
    odd = {**raw, "block_ids": {**raw["block_ids"], "sliding": [1]}}
    with pytest.raises(WireError, match="bad group 'sliding'"):
        KVTransferParams.parse(odd, BS)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("MambaSpec", "Mamba"),
        ("ChunkedLocalAttentionSpec", "chunked local attention"),
        ("MLAAttentionSpec", "full-attention and sliding-window"),
    ],
)
def test_a_group_kind_kvbridge_cannot_move_is_refused_at_startup_by_name(
    spec: str, words: str
) -> None:
    groups = [GroupKind("FullAttentionSpec", None, SHAPE), GroupKind(spec, None, SHAPE)]
    with pytest.raises(ConfigError, match=rf"group 1 is a {spec} group.*{words}"):
        plan_groups(groups, "TinyForCausalLM")


def test_groups_of_other_page_shapes_are_refused_and_the_full_group_is_main() -> None:
    sliding, full = (
        GroupKind("SlidingWindowSpec", 32, SHAPE),
        GroupKind("FullAttentionSpec", None, SHAPE),
    )
    assert plan_groups([sliding, full, sliding], "M") == (1, {0: 32, 2: 32})
    wide = GroupKind("FullAttentionSpec", None, (2, 16, "float32", BS))
    with pytest.raises(ConfigError, match="2 KV heads x 16"):
        plan_groups([sliding, wide], "M")
    longer = GroupKind("FullAttentionSpec", None, (2, 8, "float32", 4 * BS))
    with pytest.raises(ConfigError, match="16-token blocks"):
        plan_groups([sliding, longer], "M")


def test_groups_of_another_shape_at_equal_page_bytes_and_whole_block_ratios_are_moved() -> None:
    """Gemma-4: the full group's head size is twice the sliding group's, whose blocks vLLM
    made twice as long (equal page bytes)."""
    full = GroupKind("FullAttentionSpec", None, (1, 128, "float32", 32))
    sliding = GroupKind("SlidingWindowSpec", 32, (1, 64, "float32", 64))
    assert plan_groups([sliding, full], "Gemma4") == (1, {0: 32})
    assert plan_groups([full, GroupKind("SlidingWindowSpec", 8, (1, 32, "float32", 128))], "M")
    refusals = [
        # padded pages (vLLM reads them through a strided view), by name
        (GroupKind("SlidingWindowSpec", 32, (1, 64, "float32", 64), padded=True), "padded pages"),
        # other page bytes
        (GroupKind("SlidingWindowSpec", 32, (1, 64, "float32", 32)), "at equal page bytes"),
        (GroupKind("SlidingWindowSpec", 32, (1, 64, "bfloat16", 64)), "at equal page bytes"),
        # blocks that are no whole multiple of the main group's (a full group of larger
        # blocks than a sliding one included)
        (GroupKind("SlidingWindowSpec", 32, (1, 256, "float32", 16)), "whole multiple"),
    ]
    for other, words in refusals:
        with pytest.raises(ConfigError, match=rf"group 0 \(SlidingWindowSpec\).*{words}"):
            plan_groups([other, full], "Gemma4")
    wide_full = GroupKind("FullAttentionSpec", None, (1, 64, "float32", 64))
    narrow = GroupKind("SlidingWindowSpec", 32, (1, 128, "float32", 32))
    with pytest.raises(ConfigError, match="whole multiple"):
        plan_groups([narrow, wide_full], "M")


def test_group_pages_give_every_groups_shape_only_where_one_differs() -> None:
    def spec(name: str, window: int | None, heads: int, size: int, block: int) -> Any:
        out = type(name, (), {})()
        out.sliding_window, out.num_kv_heads, out.head_size = window, heads, size
        out.dtype, out.block_size = "torch.float32", block
        return out

    config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                layer_names=["l0"], kv_cache_spec=spec("SlidingWindowSpec", 32, 1, 64, 64)
            ),
            SimpleNamespace(
                layer_names=["l1"], kv_cache_spec=spec("FullAttentionSpec", None, 1, 128, 32)
            ),
        ]
    )
    names, windows = vllm_groups(config, "Gemma4")
    assert names == ("g0", "self") and windows == {"g0": 32}
    # 2 KV heads over TP=2: one per rank; the shapes name the whole model's heads
    assert group_pages(config, names, 1, 2) == {
        "g0": PageShape(64, 2, 64),
        "self": PageShape(32, 2, 128),
    }
    config.kv_cache_groups[0].kv_cache_spec = spec("SlidingWindowSpec", 32, 1, 128, 32)
    assert group_pages(config, names, 1, 1) == {}


def test_groups_that_share_their_pages_are_described_each_with_its_own_layers() -> None:
    pages = torch.zeros(2, 6, BS, 2, 8)  # one tensor: both groups' layer pages
    layout = KVLayout.from_tensors(
        {"sliding": pages, "full": pages},
        model_name="tiny",
        block_size=BS,
        layer_groups={"sliding": "g0", "full": "self"},
    )
    assert [g.name for g in layout.groups] == ["self", "g0"]
    assert layout.block_bytes("self") == layout.block_bytes("g0") == 2 * BS * 2 * 8 * 4
    assert layout.regions[0] == layout.regions[1]  # one memory, seen by two groups
    flat = torch.zeros(2 * 6 * BS * 2 * 8 + 8)
    a, b = (flat[i : i + flat.numel() - 8].view(2, 6, BS, 2, 8) for i in (0, 8))
    with pytest.raises(LayoutError, match="overlap"):  # shared bytes, not the same region
        KVLayout.from_tensors(
            {"a": a, "b": b},
            model_name="tiny",
            block_size=BS,
            layer_groups={"a": "self", "b": "g1"},
        )


def test_layers_go_to_their_vllm_groups_and_kv_sharing_layers_to_their_targets() -> None:
    config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=["l0"]),  # sliding
            SimpleNamespace(layer_names=["l1"]),  # full
        ]
    )
    layers = ["l0", "l1", "l2", "l3"]
    shares = {"l2": "l0", "l3": "l1"}  # vLLM lists the targets only
    assert layer_groups(config, GROUPS, layers, shares) == {
        "l0": "g0",
        "l1": "self",
        "l2": "g0",
        "l3": "self",
    }
    assert layer_groups(config, ("self",), layers) is None  # one group: nothing to map
    with pytest.raises(LayoutError, match="l2"):
        layer_groups(config, GROUPS, layers, {"l3": "l1"})


def test_vllm_groups_names_them_by_vllms_index_and_the_full_group_is_self() -> None:
    def spec(name: str, window: int | None) -> Any:
        cls = type(name, (), {})
        out = cls()
        out.sliding_window, out.num_kv_heads, out.head_size = window, 2, 8
        out.dtype, out.block_size = "torch.float32", BS
        return out

    config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=["l0"], kv_cache_spec=spec("SlidingWindowSpec", 32)),
            SimpleNamespace(layer_names=["l1"], kv_cache_spec=spec("FullAttentionSpec", None)),
        ]
    )
    assert vllm_groups(config, "M") == (("g0", "self"), {"g0": 32})
    one = SimpleNamespace(kv_cache_groups=config.kv_cache_groups[1:])
    assert vllm_groups(one, "M") == (("self",), {})


def test_vllms_padded_pages_are_seen_in_its_spec_and_refused() -> None:
    def spec(name: str, window: int | None, size: int, padded: int | None) -> Any:
        out = type(name, (), {})()
        out.sliding_window, out.num_kv_heads, out.head_size = window, 1, size
        out.dtype, out.block_size = "torch.float32", 32
        out.page_size_padded, out.real_page_size_bytes = padded, 2 * 32 * size * 4
        return out

    groups = [
        SimpleNamespace(layer_names=["l0"], kv_cache_spec=spec("SlidingWindowSpec", 32, 64, None)),
        SimpleNamespace(
            layer_names=["l1"], kv_cache_spec=spec("FullAttentionSpec", None, 96, None)
        ),
    ]
    config = SimpleNamespace(kv_cache_groups=groups)
    assert [k.padded for k in vllm_group_kinds(config)] == [False, False]
    groups[0].kv_cache_spec = spec("SlidingWindowSpec", 32, 64, 2 * 32 * 96 * 4)
    assert [k.padded for k in vllm_group_kinds(config)] == [True, False]
    with pytest.raises(ConfigError, match=r"group 0 \(SlidingWindowSpec\) has padded pages"):
        vllm_groups(config, "Gemma4ForCausalLM")
    # a padding equal to the page itself pads nothing
    groups[0].kv_cache_spec = spec("SlidingWindowSpec", 32, 64, 2 * 32 * 64 * 4)
    assert not vllm_group_kinds(config)[0].padded

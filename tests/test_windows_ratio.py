"""A hybrid group whose blocks hold twice ``self``'s tokens (vLLM's Gemma-4 sliding group:
64-token blocks beside the full group's 32-token ones), without vLLM: the block math, the
names, the hand-over, the decode's checks and plan, the offload store and hits, and a seal
and digests over groups of different block counts.

The 92-token prompt has ``self`` blocks 0..2 (2 full, a 28-token tail) and sliding blocks
0..1 (64 tokens, then 28). A window of 32 tokens at 92 tokens starts at token 61: sliding
block 0, so both sliding blocks move, as NixlConnector moves them. Group block ``j`` is named
after the last ``self`` block it covers (``2j + 1``, or the partial tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import xxhash

from kvbridge.connector import KVTransferParams
from kvbridge.connector.control.seal import content_tag, seal_digest
from kvbridge.connector.daemon_share import daemon_blocks, skip_offloaded
from kvbridge.connector.handover import group_name
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.scheduler import VllmScheduler, from_json_params
from kvbridge.connector.windows import AttentionGroups, block_ratios
from kvbridge.kernels import ALGO_XXH3, block_digests
from kvbridge.proto import (
    BlockHash,
    BlockId,
    ConfigError,
    GroupSpec,
    KVGroup,
    KVLayout,
    LayerSpec,
    ModelSpec,
    Region,
    RequestId,
)
from kvbridge.proto.layout import PageShape

BS = 32
WINDOW = 32
GROUPS = ("g0", "self")  # vLLM's group 0: the sliding one, 64-token blocks
SIZES = {"g0": 2 * BS}
PROMPT = list(range(1, 93))  # 92 tokens
RID = RequestId("r1")
FULL = [BlockId(b) for b in (20, 21, 22)]
SLIDING = [BlockId(b) for b in (30, 31)]
SELF_SHAPE = dict(dtype="float32", num_layers=2, num_kv_heads=1, head_size=128, block_size=BS)


class Daemon:
    """The offload daemon's names; ``lookup`` answers its leading hits, as the real one."""

    def __init__(self) -> None:
        self.names: set[bytes] = set()

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.names:
            n += 1
        return n


def _scheduler(
    role: str, sizes: dict[str, int] | None = SIZES, window: int = WINDOW, daemon: Any = None
) -> VllmScheduler:
    extra = {"control_port": 7600} if role != "kv_consumer" else {}
    cfg = VllmConnectorConfig.from_vllm(role, "engine-a", extra, model="gemma4-wide")
    pages = {g: PageShape(n, 1, 64) for g, n in (sizes or {}).items()}
    hasher = cfg.hasher(**SELF_SHAPE, pages=pages)  # type: ignore[arg-type]
    lookup = daemon.lookup if daemon is not None else None
    return VllmScheduler(
        cfg.connector, BS, hasher, lookup, groups=GROUPS, windows={"g0": window}, block_sizes=sizes
    )


def _self_names(sched: VllmScheduler, prompt: Sequence[int] = PROMPT) -> tuple[BlockHash, ...]:
    """The prompt's ``self`` names, its partial tail included."""
    view = sched._view(RID, prompt, None)
    return sched.planner._names(view, len(prompt))


def _hand_over(sliding: Sequence[int] = SLIDING, **kw: Any) -> tuple[dict[str, Any], Any]:
    prefill = _scheduler("kv_producer", **kw)
    _, params = prefill.request_finished(
        RID, PROMPT, {"do_remote_decode": True}, (list(sliding), FULL), True
    )
    assert params is not None
    (order,) = prefill.build_step()[1]
    return params, order


def test_group_block_math_counts_the_groups_own_blocks() -> None:
    wide = AttentionGroups(BS, {"g0": WINDOW}, BlockId(0), {"g0": 2})
    uniform = AttentionGroups(BS, {"g0": WINDOW}, BlockId(0))
    assert wide.start("g0", 92) == 0 and wide.start("g0", 140) == 1  # token 109 // 64
    assert uniform.start("g0", 140) == 3  # token 109 // 32: as before
    assert wide.count("g0", 3) == 2 and wide.count("g0", 4) == 2 and uniform.count("g0", 3) == 3
    assert wide.lcm == 2 and uniform.lcm == 1
    assert AttentionGroups(BS, {"g0": 8, "g1": 8}, None, {"g0": 2, "g1": 3}).lcm == 6
    a, b, c = (BlockHash(bytes([i]) * 32) for i in (1, 2, 3))
    assert wide.names("g0", (a, b, c)) == (group_name("g0", b), group_name("g0", c))
    assert wide.names("g0", (a, b, c), 1) == (group_name("g0", c),)
    assert uniform.names("g0", (a, b)) == (group_name("g0", a), group_name("g0", b))
    with pytest.raises(ConfigError, match="integer >= 1"):
        AttentionGroups(BS, {"g0": WINDOW}, None, {"g0": 0})


def test_a_block_size_no_whole_multiple_of_selfs_is_refused_with_a_sentence() -> None:
    assert block_ratios(BS, {"self": BS, "g0": 64, "g1": BS}) == {"g0": 2}
    for size in (48, 16):
        with pytest.raises(ConfigError, match=rf"'g0' has {size}-token blocks.*32-token blocks"):
            block_ratios(BS, {"g0": size})
    with pytest.raises(ConfigError, match="--kv-transfer-config"):
        _scheduler("kv_producer", {"g0": 48})


def test_prefill_hands_over_both_64_token_blocks_named_after_their_last_self_block() -> None:
    params, order = _hand_over()
    parsed = KVTransferParams.parse(from_json_params(params) or {}, BS)
    assert parsed.block_ids == {"self": tuple(FULL), "g0": tuple(SLIDING)}
    names = _self_names(_scheduler("kv_consumer"))
    assert len(names) == 3 and len(parsed.block_hashes["self"]) == 2
    # a 64-token block's name is the tagged name of its second self block; the partial
    # last one's the tagged name of the prompt's partial tail
    assert parsed.block_hashes["g0"] == (group_name("g0", names[1]), group_name("g0", names[2]))
    assert order.blocks() == {"self": tuple(FULL), "g0": tuple(SLIDING)}
    assert order.hashes()["g0"] == parsed.block_hashes["g0"]


def test_a_longer_prompt_hands_over_the_window_from_its_64_token_block() -> None:
    prompt = list(range(1, 141))  # self blocks 0..4, sliding 0..2; window from token 109
    prefill = _scheduler("kv_producer")
    sliding, full = [0, 31, 32], [20, 21, 22, 23, 24]
    _, params = prefill.request_finished(
        RID, prompt, {"do_remote_decode": True}, (sliding, full), True
    )
    assert params is not None and params["block_ids"]["g0"] == [31, 32]
    names = _self_names(prefill, prompt)
    assert [bytes.fromhex(h) for h in params["block_hashes"]["g0"]] == [
        group_name("g0", names[3]),
        group_name("g0", names[4]),
    ]
    # the null block inside the window: no hand-over (decode recomputes)
    _, none = prefill.request_finished(
        RequestId("r2"), prompt, {"do_remote_decode": True}, ([31, 0, 32], full), True
    )
    assert none is None


def test_decode_loads_each_groups_blocks_and_expects_the_leases_seal() -> None:
    params, order = _hand_over()
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (len(PROMPT), True)
    decode.after_alloc(RID, PROMPT, ([41, 42], [50, 51, 52]), len(PROMPT))
    (load,) = decode.build_step()[0].loads
    assert load.local_ids == {"self": (50, 51, 52), "g0": (41, 42)}
    assert load.remote_ids == {"self": tuple(FULL), "g0": tuple(SLIDING)}
    assert load.remote_hashes["g0"] == order.hashes()["g0"]
    assert load.lease_offset("g0") == 0 and load.whole_lease
    # the seal over groups of 3 and 2 blocks is the one the prefill's lease publishes, and
    # not the one of the same blocks named at self positions (the names a ratio of 1 gives)
    assert load.seal == seal_digest(order.blocks(), order.hashes())
    names = _self_names(decode)
    same_place = {**order.hashes(), "g0": tuple(group_name("g0", n) for n in names[:2])}
    assert load.seal != seal_digest(order.blocks(), same_place)
    # nor the seal of another name for the partial 64-token block, or of one block fewer
    g0 = order.hashes()["g0"]
    other_tail = {**order.hashes(), "g0": (g0[0], group_name("g0", names[1]))}
    assert load.seal != seal_digest(order.blocks(), other_tail)
    fewer = {**order.blocks(), "g0": order.blocks()["g0"][:1]}
    assert load.seal != seal_digest(fewer, {**order.hashes(), "g0": g0[:1]})


def test_a_local_hit_of_one_64_token_block_loads_the_rest_at_their_lease_offsets() -> None:
    params, _ = _hand_over()
    decode = _scheduler("kv_consumer")
    # vLLM's own cache holds 64 tokens: self blocks 0..1, sliding block 0
    assert decode.num_matched(RID, PROMPT, params, 2 * BS) == (len(PROMPT) - 2 * BS, True)
    decode.after_alloc(RID, PROMPT, ([41, 42], [50, 51, 52]), len(PROMPT) - 2 * BS)
    (load,) = decode.build_step()[0].loads
    assert load.local_ids == {"self": (52,), "g0": (42,)}
    assert load.remote_ids == {"self": (22,), "g0": (31,)}
    assert load.lease_offset("g0") == 1 and load.first_block == 2 and not load.whole_lease
    names = _self_names(decode)
    assert load.remote_hashes["g0"] == (group_name("g0", names[2]),)


def test_decode_refuses_group_blocks_that_are_not_its_own() -> None:
    # a prefill whose sliding group has 32-token blocks: it hands over blocks 1..2 of 3,
    # named as this decode names its blocks 0..1 (group names alone do not tell the block
    # sizes apart), but its fingerprint, so every self name, is another
    params, _ = _hand_over(sliding=[30, 31, 32], sizes=None)
    assert params["block_ids"]["g0"] == [31, 32]
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (0, False)
    assert "block hashes do not match this prompt" in decode.planner.refused[RID][0]
    # more group blocks than the prompt has, named so that they would pass at negative
    # positions (block -1 named after the last self block)
    params, _ = _hand_over()
    names = _self_names(_scheduler("kv_consumer"))
    params["block_ids"]["g0"] = [29, 30, 31]
    params["block_hashes"]["g0"] = [group_name("g0", names[i]).hex() for i in (2, 1, 2)]
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (0, False)
    assert "3 'g0' blocks; the prompt has 2" in decode.planner.refused[RID][0]
    # names in another order
    params, _ = _hand_over()
    params["block_hashes"]["g0"] = params["block_hashes"]["g0"][::-1]
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (0, False)
    assert "'g0' block names do not match" in decode.planner.refused[RID][0]
    # a prefill whose window (16 tokens: from token 77, block 1) is narrower than decode's
    params, _ = _hand_over(window=16)
    assert params["block_ids"]["g0"] == [31]
    decode = _scheduler("kv_consumer")
    assert decode.num_matched(RID, PROMPT, params, 0) == (0, False)
    assert "decode's window needs 2" in decode.planner.refused[RID][0]


COMPUTED = list(range(1, 141))  # the prompt and 48 generated tokens: 4 full self blocks


def _store(daemon: Daemon) -> tuple[VllmScheduler, Any]:
    sched = _scheduler("kv_both", daemon=daemon)
    delay_free, _ = sched.request_finished(
        RequestId("w"), PROMPT, None, ([0, 31, 32], [20, 21, 22, 23, 24]), True, COMPUTED
    )
    assert delay_free
    (store,) = sched.build_step()[0].stores
    daemon.names.update(bytes(h) for h in store.hashes)
    return sched, store


def test_a_store_takes_the_full_64_token_blocks_under_their_names() -> None:
    sched, store = _store(Daemon())
    names = sched.hasher.hash_blocks(COMPUTED)
    assert len(names) == 4
    # self's 4 full blocks; the sliding group's full blocks are 0 (the null block: not
    # stored) and 1 (named after self block 3); its block 2 is partial: not stored
    assert list(store.block_ids) == [20, 21, 22, 23, 31]
    assert list(store.hashes) == [*names, group_name("g0", names[3])]


def test_a_store_never_takes_a_64_token_block_its_self_blocks_only_half_fill() -> None:
    daemon = Daemon()
    sched = _scheduler("kv_both", window=64, daemon=daemon)  # keeps both sliding blocks
    computed = list(range(1, 101))  # 100 tokens: 3 full self blocks
    delay_free, _ = sched.request_finished(
        RequestId("w"), PROMPT, None, ([30, 31], [20, 21, 22, 23]), True, computed
    )
    (store,) = sched.build_step()[0].stores
    names = sched.hasher.hash_blocks(computed)
    assert delay_free and len(names) == 3
    assert list(store.block_ids) == [20, 21, 22, 30]
    assert list(store.hashes) == [*names, group_name("g0", names[1])]


def test_an_offload_hit_ends_on_a_64_token_boundary() -> None:
    daemon = Daemon()
    sched, _ = _store(daemon)
    names = sched.hasher.hash_blocks(COMPUTED)
    follow = [*COMPUTED[:128], *range(500, 572)]  # 200 tokens: 6 full blocks asked
    reader = _scheduler("kv_both", daemon=daemon)
    rid = RequestId("n")
    # self blocks 0..3 held, and the window at 128 tokens (from token 97: sliding block 1)
    assert reader.num_matched(rid, follow, None, 0) == (4 * BS, True)
    reader.after_alloc(rid, follow, ([0, 44, 45, 46], [60, 61, 62, 63, 64, 65, 66]), 4 * BS)
    (load,) = reader.build_step()[0].loads
    assert load.local_ids == {"self": (60, 61, 62, 63), "g0": (44,)}
    assert load.offload_groups == {"g0": (group_name("g0", names[3]),)}
    # self block 3 gone: 3 self blocks held, a hit of 96 tokens would end inside sliding
    # block 1; it is cut to 64 tokens, whose window is sliding block 0: not held
    daemon.names.discard(bytes(names[3]))
    assert reader.num_matched(RequestId("m"), follow, None, 0) == (0, False)
    daemon.names.add(bytes(group_name("g0", names[1])))
    assert reader.num_matched(RequestId("k"), follow, None, 0) == (2 * BS, True)
    reader.after_alloc(RequestId("k"), follow, ([43, 44, 45, 46], list(range(60, 67))), 2 * BS)
    (load,) = reader.build_step()[0].loads
    assert load.local_ids == {"self": (60, 61), "g0": (43,)}
    assert load.offload_groups == {"g0": (group_name("g0", names[1]),)}


def test_a_decode_takes_the_daemons_64_token_blocks_and_the_rest_from_prefill() -> None:
    params, _ = _hand_over()
    daemon = Daemon()
    decode = _scheduler("kv_consumer", daemon=daemon)
    names = _self_names(decode)
    # the daemon holds self blocks 0..1 and sliding block 0 (self blocks 0..1's tokens)
    daemon.names.update([*names[:2], group_name("g0", names[1])])
    assert decode.num_matched(RID, PROMPT, params, 0) == (len(PROMPT), True)
    decode.after_alloc(RID, PROMPT, ([41, 42], [50, 51, 52]), len(PROMPT))
    (load,) = decode.build_step()[0].loads
    assert load.offload_hashes == names[:2]
    assert load.offload_groups == {"g0": (group_name("g0", names[1]),)}
    assert daemon_blocks(load) == (
        [50, 51, 41],
        [*names[:2], group_name("g0", names[1])],
    )
    rest = skip_offloaded(load, 2, groups=True)
    assert rest.local_ids == {"self": (52,), "g0": (42,)}
    assert rest.remote_ids == {"self": (22,), "g0": (31,)}
    assert rest.lease_offset("g0") == 1 and rest.first_block == 2


def test_a_decode_never_takes_a_partial_64_token_block_from_the_daemon() -> None:
    prompt = list(range(1, 101))  # 100 tokens: self blocks 0..3 (3 full), sliding 0..1
    prefill = _scheduler("kv_producer")
    _, params = prefill.request_finished(
        RID, prompt, {"do_remote_decode": True}, ([0, 31], [20, 21, 22, 23]), True
    )
    assert params is not None and params["block_ids"]["g0"] == [31]  # window from token 69
    daemon = Daemon()
    decode = _scheduler("kv_consumer", daemon=daemon)
    names = _self_names(decode, prompt)
    # the daemon serves self blocks 0..2; sliding block 1 covers self blocks 2 and 3 (the
    # tail), so it is not the daemon's to give, even under the name it would have
    daemon.names.update([*names[:3], group_name("g0", names[2])])
    assert decode.num_matched(RID, prompt, params, 0) == (len(prompt), True)
    decode.after_alloc(RID, prompt, ([0, 42], [50, 51, 52, 53]), len(prompt))
    (load,) = decode.build_step()[0].loads
    assert load.offload_hashes == names[:3] and load.offload_groups == {}
    assert load.local_ids["g0"] == (42,) and load.remote_ids["g0"] == (31,)


def test_the_fingerprint_takes_group_shapes_only_where_they_differ() -> None:
    cfg = VllmConnectorConfig.from_vllm("kv_consumer", "engine-a", {}, model="gemma4-wide")

    def first_name(**pages: PageShape) -> bytes:
        return bytes(cfg.hasher(**SELF_SHAPE, pages=pages).hash_blocks(PROMPT)[0])  # type: ignore[arg-type]

    plain = first_name()
    assert first_name(g0=PageShape(BS, 1, 128)) == plain  # self's shape: as before
    wide = first_name(g0=PageShape(64, 1, 64))
    assert wide != plain and first_name(g0=PageShape(64, 1, 32)) not in (plain, wide)
    assert first_name(g0=PageShape(64, 1, 64), g1=PageShape(BS, 1, 128)) == wide


def _bound() -> tuple[KVLayout, list[torch.Tensor]]:
    """A bound block-outermost layout: self 3 blocks of 32 tokens x 1 head x 128, g0 2 blocks
    of 64 tokens x 1 head x 128 (pages twice self's bytes, so a span taken at self's
    geometry lands elsewhere)."""
    lay = KVLayout(
        model=ModelSpec("gemma4-wide", "float32", 1, 1, 128),
        block_size=BS,
        groups=(GroupSpec(KVGroup.SELF, 3), GroupSpec("g0", 2, PageShape(64, 1, 128))),
        layers=(LayerSpec("layers.1", KVGroup.SELF), LayerSpec("layers.0", "g0")),
    ).with_order("block-nhd")
    mems = [torch.rand(lay.region_bytes(i) // 4) for i in range(lay.num_regions)]
    regions = [Region(t.data_ptr(), t.numel() * 4) for t in mems]
    return lay.with_regions(regions), mems


def test_digests_and_their_tag_over_groups_of_different_block_counts() -> None:
    lay, mems = _bound()
    key = 7
    mine = block_digests(lay, KVGroup.SELF, [0, 1, 2], key)
    theirs = block_digests(lay, "g0", [0, 1], key)
    assert len(set(mine + theirs)) == 5
    # each g0 digest covers exactly its 64-token page: 64 x 1 x 128 floats, K and V
    g0 = mems[lay.regions_of("g0").start]
    page = 2 * 64 * 128
    assert g0.numel() == 2 * page
    for b in (0, 1):
        raw = g0[b * page : (b + 1) * page].numpy().tobytes()
        assert theirs[b] == xxhash.xxh3_128_digest(raw, seed=key)
    tag = content_tag("ab" * 16, b"s" * 32, key, ALGO_XXH3, {"self": mine, "g0": theirs})
    # a float in the last quarter of g0's block 1 changes that block's digest only
    g0[g0.numel() - 5] += 1.0
    after = block_digests(lay, "g0", [0, 1], key)
    assert after[0] == theirs[0] and after[1] != theirs[1]
    assert block_digests(lay, KVGroup.SELF, [0, 1, 2], key) == mine
    assert content_tag("ab" * 16, b"s" * 32, key, ALGO_XXH3, {"self": mine, "g0": after}) != tag
    # a tag over self's blocks alone (the group's left out) is another tag
    assert content_tag("ab" * 16, b"s" * 32, key, ALGO_XXH3, {"self": mine}) != tag

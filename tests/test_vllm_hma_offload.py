"""The CPU offload daemon with vLLM's hybrid KV cache groups kept, without vLLM: what a
finished request stores, which prefix a new request loads, and the worker's checks.

kvbridge's ``self`` group is the full-attention group; a sliding-window group ``g0`` holds
only the blocks still inside its window (vLLM's null block, id 0, elsewhere). The daemon
keys a block by its name, so a group's block is stored under its group name
(:func:`~kvbridge.connector.handover.group_name`): never the ``self`` block of the same
position. A prefix hit of ``P`` blocks needs every ``self`` block before ``P`` and the
group's blocks of the window at ``P`` blocks' tokens. The daemon here is a set of names
whose lookup answers leading hits, as the real one does; the run inside real vLLM is
``test_vllm_offload_hybrid.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvbridge.connector import BlockLoad, ConnectorConfig, LoadResult
from kvbridge.connector.handover import group_name
from kvbridge.connector.offload import OffloadLoadResult
from kvbridge.connector.offload.session import check_shared_pages
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.scheduler import VllmScheduler
from kvbridge.connector.vllm.worker import VllmWorker, WorkerSettings
from kvbridge.connector.windows import MAX_GROUP_LOOKUPS, AttentionGroups
from kvbridge.connector.worker_side import KVBridgeWorker
from kvbridge.proto import BlockHash, BlockId, ConfigError, KVLayout, RequestId

BS = 4
WINDOW = 8  # tokens: two blocks; after 21 tokens vLLM keeps blocks 3.. (tokens 14..)
GROUPS = ("g0", "self")  # vLLM's group 0 is the sliding one, group 1 the full one
PROMPT = list(range(1, 19))  # 18 tokens
COMPUTED = [*PROMPT, 40, 41, 42]  # 21 tokens with KV: 5 full blocks
FULL = [BlockId(b) for b in (20, 21, 22, 23, 24, 25)]
SLIDING = [BlockId(b) for b in (0, 0, 0, 33, 34, 35)]  # vLLM freed blocks 0..2 (null block)
FOLLOW = [*COMPUTED[:20], 50, 51, 52, 53, 54]  # the next turn: 25 tokens, 6 full blocks


class Daemon:
    """The daemon's names; ``lookup`` answers its leading hits and counts the calls."""

    def __init__(self) -> None:
        self.names: set[bytes] = set()
        self.asked: list[tuple[bytes, ...]] = []

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        self.asked.append(tuple(hashes))
        n = 0
        while n < len(hashes) and hashes[n] in self.names:
            n += 1
        return n


def _scheduler(daemon: Daemon, window: int | None = WINDOW, role: str = "kv_both") -> Any:
    extra = {"control_port": 7600} if role != "kv_consumer" else {}
    cfg = VllmConnectorConfig.from_vllm(role, "engine-a", extra, model="tiny")
    hasher = cfg.hasher(dtype="float32", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS)
    return VllmScheduler(
        cfg.connector, BS, hasher, daemon.lookup, groups=GROUPS, windows={"g0": window}
    )


def _store(daemon: Daemon, sliding: Sequence[int] = SLIDING) -> tuple[Any, Any]:
    """A finished request's store, its names put into the daemon."""
    sched = _scheduler(daemon)
    delay_free, _ = sched.request_finished(
        RequestId("w"), PROMPT, None, (list(sliding), FULL), True, COMPUTED
    )
    assert delay_free
    (store,) = sched.build_step()[0].stores
    daemon.names.update(bytes(h) for h in store.hashes)
    return sched, store


def _names(sched: Any, tokens: Sequence[int]) -> list[bytes]:
    return [bytes(h) for h in sched.hasher.hash_blocks(list(tokens))]


def test_a_store_takes_the_full_blocks_and_the_windows_blocks_under_the_groups_names() -> None:
    sched, store = _store(Daemon())
    names = _names(sched, COMPUTED)
    assert len(names) == 5
    # the full group's 5 full blocks, then the sliding group's blocks of positions 3 and 4
    # (its block 35 holds the partial sixth block: not stored; null blocks never)
    assert list(store.block_ids) == [20, 21, 22, 23, 24, 33, 34]
    assert [bytes(h) for h in store.hashes] == [
        *names,
        group_name("g0", BlockHash(names[3])),
        group_name("g0", BlockHash(names[4])),
    ]
    # a group's block never goes under the name of the self block of its position
    assert not set(store.hashes[5:]) & set(store.hashes[:5])
    assert BlockId(0) not in store.block_ids


def test_a_null_block_inside_the_range_is_skipped_not_stored() -> None:
    _, store = _store(Daemon(), sliding=(0, 0, 0, 0, 34, 35))
    assert list(store.block_ids) == [20, 21, 22, 23, 24, 34]


def test_a_new_request_loads_the_full_blocks_and_the_window_at_the_hits_end() -> None:
    daemon = Daemon()
    _store(daemon)
    reader = _scheduler(daemon)
    rid = RequestId("r")
    # 6 full blocks, the last token left to compute: 5 blocks asked, all held by self; the
    # window at 20 tokens (tokens 13..) is the sliding group's blocks 3 and 4: held
    assert reader.num_matched(rid, FOLLOW, None, 0) == (5 * BS, True)
    local_sliding = [0, 0, 0, 43, 44, 45, 46]
    local_full = [60, 61, 62, 63, 64, 65, 66]
    reader.after_alloc(rid, FOLLOW, (local_sliding, local_full), 5 * BS)
    (load,) = reader.build_step()[0].loads
    names = _names(reader, FOLLOW)
    assert load.local_ids == {"self": (60, 61, 62, 63, 64), "g0": (43, 44)}
    assert [bytes(h) for h in load.offload_hashes] == names[:5]
    assert load.offload_groups == {
        "g0": (group_name("g0", BlockHash(names[3])), group_name("g0", BlockHash(names[4])))
    }
    assert not load.remote_engine


def test_a_window_the_daemon_lacks_means_no_hit_even_with_every_full_block() -> None:
    daemon = Daemon()
    _, store = _store(daemon)
    daemon.names.discard(bytes(store.hashes[5]))  # the sliding group's block 3
    reader = _scheduler(daemon)
    # P=5 needs g0's 3 and 4; P=3 needs 1 and 2; P=1 needs 0: none stored
    assert reader.num_matched(RequestId("r"), FOLLOW, None, 0) == (0, False)
    assert reader.build_step()[0].loads == ()


def test_a_missing_window_block_lowers_the_hit_to_it() -> None:
    daemon = Daemon()
    sched, _ = _store(daemon)
    names = _names(sched, COMPUTED)
    daemon.names.update(bytes(group_name("g0", BlockHash(n))) for n in names[:3])
    daemon.names.discard(bytes(group_name("g0", BlockHash(names[3]))))
    reader = _scheduler(daemon)
    # P=5 misses g0's block 3, so every P > 3 does; P=3 needs blocks 1 and 2: held
    assert reader.num_matched(RequestId("r"), FOLLOW, None, 0) == (3 * BS, True)
    assert daemon.asked[-2:] == [
        tuple(group_name("g0", BlockHash(n)) for n in names[3:5]),
        tuple(group_name("g0", BlockHash(n)) for n in names[1:3]),
    ]
    reader.after_alloc(RequestId("r"), FOLLOW, ([0, 41, 42, 43, 44], [60, 61, 62, 63, 64]), 12)
    (load,) = reader.build_step()[0].loads
    assert load.local_ids == {"self": (60, 61, 62), "g0": (41, 42)}


def test_a_local_prefix_hit_inside_the_window_asks_and_loads_only_the_rest() -> None:
    daemon = Daemon()
    _store(daemon)
    reader = _scheduler(daemon)
    names = _names(reader, FOLLOW)
    # vLLM's own cache holds 4 blocks of each group (it holds the window before them)
    assert reader.num_matched(RequestId("r"), FOLLOW, None, 4 * BS) == (BS, True)
    # blocks 4 and 5 asked (5 is not held), then g0's block 4 only: vLLM holds its 3
    assert daemon.asked == [tuple(names[4:6]), (group_name("g0", BlockHash(names[4])),)]
    reader.after_alloc(RequestId("r"), FOLLOW, ([0, 0, 0, 43, 44, 45], [60] * 6), BS)
    (load,) = reader.build_step()[0].loads
    assert load.local_ids == {"self": (60,), "g0": (44,)}


def test_the_engines_null_block_is_never_loaded_into() -> None:
    daemon = Daemon()
    _store(daemon)
    reader = _scheduler(daemon)
    assert reader.num_matched(RequestId("r"), FOLLOW, None, 0) == (5 * BS, True)
    # vLLM keeps no block at position 3 (it does not attend to it): nothing loads there
    reader.after_alloc(RequestId("r"), FOLLOW, ([0, 0, 0, 0, 44, 45], [60] * 6), 5 * BS)
    (load,) = reader.build_step()[0].loads
    assert load.local_ids["g0"] == (44,)
    assert len(load.offload_groups["g0"]) == 1


def test_a_group_without_a_window_needs_every_block_of_the_prefix() -> None:
    groups = AttentionGroups(BS, {"g0": None}, BlockId(0))
    names = [BlockHash(bytes([i]) * 32) for i in range(6)]
    held = {group_name("g0", n) for n in names[:2]}
    daemon = Daemon()
    daemon.names = {bytes(h) for h in held}
    assert groups.offload_hit(names, 0, 5, daemon.lookup) == 2
    assert groups.offload_hit(names, 0, 1, daemon.lookup) == 1


def test_the_plan_asks_the_daemon_a_bounded_number_of_times() -> None:
    groups = AttentionGroups(BS, {"g0": 2 * BS}, BlockId(0))
    names = [BlockHash(bytes([i]) * 32) for i in range(100)]
    held = {group_name("g0", n) for i, n in enumerate(names) if i % 2}  # every other one
    daemon = Daemon()
    daemon.names = {bytes(h) for h in held}
    assert groups.offload_hit(names, 0, 99, daemon.lookup) == 0
    assert len(daemon.asked) == MAX_GROUP_LOOKUPS


def _handed_over(sliding: Sequence[int] = (0, 0, 0, 0, 34, 35, 36)) -> dict[str, Any]:
    """A prefill's hand-over of FOLLOW (25 tokens: 6 full blocks and 1 token; the sliding
    group's window at 25 tokens is its blocks 4..6)."""
    prefill = _scheduler(Daemon(), role="kv_producer")
    _, params = prefill.request_finished(
        RequestId("p"), FOLLOW, {"do_remote_decode": True}, (list(sliding), [*FULL, 26]), True
    )
    assert params is not None
    return params


def test_a_decode_with_remote_prefill_takes_what_the_daemon_holds_of_every_group() -> None:
    """Like a Llama decode (the daemon's leading ``self`` blocks, the rest from prefill),
    per group: the daemon holds ``self`` blocks 0..4 and the sliding group's 3 and 4; the
    decode's window at 25 tokens is blocks 4..6, so it takes its block 4 from the daemon
    (never 3: outside the window) and 5 and 6 from prefill."""
    daemon = Daemon()
    _store(daemon)
    params = _handed_over()
    decode = _scheduler(daemon, role="kv_consumer")
    names = _names(decode, FOLLOW)
    daemon.asked.clear()
    assert decode.num_matched(RequestId("p"), FOLLOW, params, 0) == (len(FOLLOW), True)
    # prefill's 6 full blocks (5 held), then the sliding group's window before block 5
    assert daemon.asked == [tuple(names[:6]), (group_name("g0", BlockHash(names[4])),)]
    local = ([0, 0, 0, 0, 44, 45, 46], [60 + i for i in range(7)])
    decode.after_alloc(RequestId("p"), FOLLOW, local, 25)
    (load,) = decode.build_step()[0].loads
    assert load.remote_engine and load.local_ids == {
        "self": (60, 61, 62, 63, 64, 65, 66),
        "g0": (44, 45, 46),
    }
    assert load.remote_ids == {"self": (20, 21, 22, 23, 24, 25, 26), "g0": (34, 35, 36)}
    assert [bytes(h) for h in load.offload_hashes] == names[:5]
    assert load.offload_groups == {"g0": (group_name("g0", BlockHash(names[4])),)}
    assert load.lease_offsets == {"g0": 0}


def test_a_decode_takes_no_group_block_from_the_daemon_past_its_self_hits() -> None:
    """The daemon serves positions before its ``self`` hits' end only: with ``self`` block
    4 gone, the sliding group's block 4 comes from prefill too."""
    daemon = Daemon()
    _, store = _store(daemon)
    daemon.names.discard(bytes(store.hashes[4]))
    decode = _scheduler(daemon, role="kv_consumer")
    assert decode.num_matched(RequestId("p"), FOLLOW, _handed_over(), 0) == (25, True)
    decode.after_alloc(RequestId("p"), FOLLOW, ([0, 0, 0, 0, 44, 45, 46], [60] * 7), 25)
    (load,) = decode.build_step()[0].loads
    assert len(load.offload_hashes) == 4 and load.offload_groups == {}


def test_a_decode_without_a_daemon_hit_asks_once_and_loads_every_group_from_prefill() -> None:
    daemon = Daemon()
    decode = _scheduler(daemon, role="kv_consumer")
    assert decode.num_matched(RequestId("p"), FOLLOW, _handed_over(), 0) == (25, True)
    assert len(daemon.asked) == 1  # the self blocks: none held, no group asked
    decode.after_alloc(RequestId("p"), FOLLOW, ([0, 0, 0, 0, 44, 45, 46], [60] * 7), 25)
    (load,) = decode.build_step()[0].loads
    assert load.offload_hashes == () and load.offload_groups == {}


# ----- the worker --------------------------------------------------------------------------


def _hybrid(shared: bool) -> KVLayout:
    full = torch.zeros(2, 6, BS, 2, 8)
    sliding = full if shared else torch.zeros(2, 6, BS, 2, 8)
    return KVLayout.from_tensors(
        {"sliding": sliding, "full": full},
        model_name="tiny",
        block_size=BS,
        layer_groups={"sliding": "g0", "full": "self"},
    )


def test_groups_that_share_selfs_pages_are_offloaded_and_others_refused() -> None:
    check_shared_pages(_hybrid(shared=True))
    with pytest.raises(ConfigError, match=r"offload_address: KV cache group 'g0' does not"):
        check_shared_pages(_hybrid(shared=False))


class _Client:
    """The offload client's ``load``: the daemon holds the first ``held`` blocks."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.calls: list[tuple[list[int], list[bytes]]] = []

    def load(self, ids: Sequence[BlockId], hashes: Sequence[BlockHash]) -> OffloadLoadResult:
        self.calls.append((list(ids), [bytes(h) for h in hashes]))
        got = min(self.held, len(ids))
        return OffloadLoadResult(loaded=got, error="" if got == len(ids) else "gone")


def _group_load() -> BlockLoad:
    return BlockLoad(
        request_id=RequestId("r"),
        remote_engine="",
        remote_address="",
        local_ids={"self": (60, 61, 62), "g0": (42,)},
        remote_ids={},
        offload_hashes=(b"a" * 32, b"b" * 32, b"c" * 32),
        offload_groups={"g0": (b"g" * 32,)},
    )


@pytest.mark.parametrize("held", [4, 3, 0])
def test_a_group_load_is_one_load_and_any_shortfall_recomputes_all_of_it(held: int) -> None:
    client = _Client(held)
    worker: Any = SimpleNamespace(_remote=object(), offload=client)
    worker._load_groups = lambda load: KVBridgeWorker._load_groups(worker, load)
    result = KVBridgeWorker._load(worker, _group_load())
    assert client.calls == [([60, 61, 62, 42], [b"a" * 32, b"b" * 32, b"c" * 32, b"g" * 32])]
    assert result.blocks_requested == 4
    if held == 4:
        assert (result.blocks_offloaded, result.bad_block_ids, result.error) == (4, (), "")
    else:  # the self blocks alone are no prefix without the window: none are kept
        assert result.blocks_offloaded == 0
        assert result.bad_block_ids == (60, 61, 62, 42) and result.error


class _Remote:
    """The remote loader: records the load it is given and reads all of it."""

    def __init__(self) -> None:
        self.loads: list[BlockLoad] = []

    def load(self, load: BlockLoad) -> LoadResult:
        self.loads.append(load)
        n = sum(len(ids) for ids in load.local_ids.values())
        return LoadResult(load.request_id, n, n, (), 1.0)


def _pd_group_load() -> BlockLoad:
    """A hybrid decode's load: ``self`` blocks 0..3 (2 from the daemon), the sliding group's
    blocks 2..3 (1 from the daemon), verified against the params' digests."""
    return BlockLoad(
        request_id=RequestId("r"),
        remote_engine="prefill",
        remote_address="127.0.0.1:1",
        local_ids={"self": (60, 61, 62, 63), "g0": (42, 43)},
        remote_ids={"self": (20, 21, 22, 23), "g0": (32, 33)},
        remote_hashes={"self": (b"a", b"b", b"c", b"d"), "g0": (b"G", b"H")},
        offload_hashes=(b"a" * 32, b"b" * 32),
        offload_groups={"g0": (b"g" * 32,)},
        digests={"self": (b"1", b"2", b"3", b"4"), "g0": (b"5", b"6")},
        lease_offsets={"g0": 2},
        whole_lease=True,
    )


@pytest.mark.parametrize("held", [3, 2, 0])
def test_a_hybrid_decode_takes_every_groups_daemon_blocks_or_none_and_the_rest_from_prefill(
    held: int,
) -> None:
    client, remote = _Client(held), _Remote()
    worker: Any = SimpleNamespace(_remote=remote, offload=client)
    worker._load_groups = lambda load: KVBridgeWorker._load_groups(worker, load)
    worker._from_remote = lambda *a: KVBridgeWorker._from_remote(worker, *a)
    result = KVBridgeWorker._load(worker, _pd_group_load())
    assert client.calls == [([60, 61, 42], [b"a" * 32, b"b" * 32, b"g" * 32])]
    (rest,) = remote.loads
    assert not result.error and result.blocks_requested == 6
    if held == 3:  # the rest: self 2..3 and the sliding group's block 3, in their lease places
        assert result.blocks_offloaded == 3 and result.blocks_moved == 3
        assert rest.local_ids == {"self": (62, 63), "g0": (43,)}
        assert rest.remote_ids == {"self": (22, 23), "g0": (33,)}
        assert rest.remote_hashes == {"self": (b"c", b"d"), "g0": (b"H",)}
        assert rest.digests == {"self": (b"3", b"4"), "g0": (b"6",)}
        assert (rest.first_block, rest.lease_offsets, rest.whole_lease) == (2, {"g0": 3}, False)
    else:  # a shortfall: every block from prefill, none kept from the daemon
        assert result.blocks_offloaded == 0 and result.blocks_moved == 6
        assert rest.local_ids == _pd_group_load().local_ids
        assert rest.first_block == 0 and rest.lease_offsets == {"g0": 2}


class _Loader:
    """A worker's loader whose finished loads are ``results``."""

    def __init__(self, results: dict[str, LoadResult]) -> None:
        self.results = results

    def get_finished(self, _: set[str]) -> tuple[set[str], set[str]]:
        return set(), set(self.results)

    def pop_result(self, rid: str) -> LoadResult | None:
        return self.results.pop(rid, None)


def test_a_failed_load_is_reported_by_request_once() -> None:
    """vLLM maps failed block ids to requests for one KV cache group only: with several,
    the connector reports the request (``failed_recving``) from ``take_failed``."""
    worker = VllmWorker(ConnectorConfig("engine-a"), WorkerSettings("tiny", BS))
    ok = LoadResult(RequestId("ok"), 2, 0, (), 1.0, blocks_offloaded=2)
    bad = LoadResult(RequestId("bad"), 2, 0, (BlockId(60), BlockId(42)), 1.0, error="gone")
    worker.loader = _Loader({"ok": ok, "bad": bad})  # type: ignore[assignment]
    assert worker.get_finished() == (set(), {"ok", "bad"})
    assert worker.take_failed() == {"bad"}
    assert worker.take_failed() == set()

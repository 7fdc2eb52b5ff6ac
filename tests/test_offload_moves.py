"""The offload mover overlaps digests with transfers: a big store is digested piece by piece
while earlier pieces are written, a big verified load checks each piece after its READ
landed while the next one is read; bytes, digests and failures are those of one transfer."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvbridge.connector.offload import moves
from kvbridge.connector.offload.moves import BlockMover
from kvbridge.connector.transport import LocalMemory
from kvbridge.kernels import ALGO_XXH3, block_digests, copy_blocks, new_key
from kvbridge.proto import KVGroup, KVLayout, TransferError, preset_layout

BLOCKS = 5


@dataclass
class _Handle:
    def wait(self) -> None:
        pass

    def release(self) -> None:
        pass


@dataclass
class _Pool:
    """A fake transport whose "remote" is a second cache in this process; records each call."""

    layout: KVLayout
    kv: dict[str, torch.Tensor]
    local_kv: dict[str, torch.Tensor]
    calls: list[tuple[str, list[int], bytes | None, int]] = field(default_factory=list)
    fail_on: int | None = None  # the index of the call that fails

    def _move(self, op: str, local: list[int], remote: list[int], notify: bytes | None) -> _Handle:
        self.calls.append((op, list(local), notify, threading.get_ident()))
        if self.fail_on is not None and len(self.calls) - 1 == self.fail_on:
            raise TransferError(f"{op} failed (test)")
        if op == "read":
            copy_blocks(self.kv, self.local_kv, self.layout, list(zip(remote, local, strict=True)))
        else:
            copy_blocks(self.local_kv, self.kv, self.layout, list(zip(local, remote, strict=True)))
        return _Handle()

    def read_blocks(self, link: Any, group: str, local: list[int], remote: list[int], *,
                    notify: bytes | None = None, timeout_s: float) -> _Handle:  # fmt: skip
        return self._move("read", local, remote, notify)

    def write_blocks(self, link: Any, group: str, local: list[int], remote: list[int], *,
                     notify: bytes | None = None, timeout_s: float) -> _Handle:  # fmt: skip
        return self._move("write", local, remote, notify)


@dataclass
class _Session:
    link: Any = None
    staging: Any = None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Random bytes include NaN patterns: compare bits, not floats."""
    return t.view(torch.int32)


def _filled(layout: KVLayout, seed: int) -> dict[str, torch.Tensor]:
    kv = layout.allocate()
    gen = torch.Generator().manual_seed(seed)
    for t in kv.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return kv


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> Any:
    layout = preset_layout("tiny", num_blocks=BLOCKS)
    # two blocks per piece: a transfer of 5 blocks goes as [0, 1], [2, 3], [4]
    for knob in ("PIPELINE_BYTES", "FIRST_PIECE_BYTES", "MAX_PIECE_BYTES"):
        monkeypatch.setattr(moves, knob, 2 * layout.block_bytes())
    local_kv, pool_kv = _filled(layout, 1), _filled(layout, 2)
    local = LocalMemory(1, layout.bind(local_kv), "cpu")
    pool = _Pool(layout, pool_kv, local_kv)
    mover = BlockMover(pool, local, None, 5.0)  # type: ignore[arg-type]
    yield mover, pool, local
    mover.close()


def test_a_big_store_is_written_in_pieces_on_the_helper_with_notify_on_the_last(
    setup: Any,
) -> None:
    mover, pool, local = setup
    ids, slots, key = [4, 0, 3, 1, 2], [0, 1, 2, 3, 4], new_key()
    algo, digests = mover.write(_Session(), ids, slots, b"stored", key)
    assert algo == ALGO_XXH3
    assert digests == block_digests(local.layout, KVGroup.SELF, ids, key)
    assert [(op, blocks, note) for op, blocks, note, _ in pool.calls] == [
        ("write", [4, 0], None),
        ("write", [3, 1], None),
        ("write", [2], b"stored"),
    ]
    assert threading.get_ident() not in {thread for *_, thread in pool.calls}
    for layer in local.layout.owning_layers(KVGroup.SELF):
        assert torch.equal(
            _bits(pool.kv[layer.name])[:, slots], _bits(pool.local_kv[layer.name])[:, ids]
        )


def test_a_big_verified_load_checks_each_piece_and_names_the_bad_block(setup: Any) -> None:
    mover, pool, local = setup
    key = new_key()
    slots, ids = [4, 2, 0, 1, 3], [0, 1, 2, 3, 4]
    # what the writer recorded for each pool slot, then slot 1 (position 3) is overwritten
    pool_layout = preset_layout("tiny", num_blocks=BLOCKS).bind(pool.kv)
    want = block_digests(pool_layout, KVGroup.SELF, slots, key)
    layer = local.layout.owning_layers(KVGroup.SELF)[0].name
    pool.kv[layer][:, 1].view(torch.uint8).bitwise_not_()
    digests = [(key, d, ALGO_XXH3) for d in want]
    bad, verify_s = mover.read(_Session(), ids, slots, digests)
    assert bad == [3] and verify_s > 0
    # a load's pieces are a store's in reverse: the piece checked after the last READ is small
    assert [(op, blocks) for op, blocks, *_ in pool.calls] == [
        ("read", [0]),
        ("read", [1, 2]),
        ("read", [3, 4]),
    ]
    for x in local.layout.owning_layers(KVGroup.SELF):
        assert torch.equal(_bits(pool.local_kv[x.name])[:, ids], _bits(pool.kv[x.name])[:, slots])


def test_pieces_grow_from_the_first_size_to_the_max_and_a_load_ends_on_the_small_one(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mover, _, local = setup
    block = local.layout.block_bytes()
    monkeypatch.setattr(moves, "FIRST_PIECE_BYTES", block)
    monkeypatch.setattr(moves, "MAX_PIECE_BYTES", 4 * block)
    assert mover._pieces(12) == [(0, 1), (1, 3), (3, 7), (7, 11), (11, 12)]
    assert mover._pieces(12, small_last=True) == [(0, 1), (1, 5), (5, 9), (9, 11), (11, 12)]
    assert mover._pieces(2) == [(0, 2)]  # up to PIPELINE_BYTES (2 blocks here): one piece
    assert mover._pieces(0) == []


@pytest.mark.parametrize("blocks", [2, 5])
def test_a_store_hands_its_digests_on_before_its_last_write(setup: Any, blocks: int) -> None:
    # the client posts CommitStore from on_digests: the daemon then waits for the notification
    mover, pool, local = setup
    ids, key = list(range(blocks)), new_key()
    seen: list[tuple[list[bytes], list[bytes | None]]] = []

    def on_digests(algo: str, digests: list[bytes]) -> None:
        seen.append((list(digests), [note for _, _, note, _ in pool.calls]))

    _, digests = mover.write(_Session(), ids, ids, b"stored", key, on_digests=on_digests)
    assert digests == block_digests(local.layout, KVGroup.SELF, ids, key)
    assert len(seen) == 1 and seen[0][0] == digests and b"stored" not in seen[0][1]
    assert pool.calls[-1][2] == b"stored"


def test_digests_taken_while_prepare_store_is_in_flight_are_the_writes_own(setup: Any) -> None:
    mover, pool, local = setup
    key, ids = new_key(), [3, 1, 4, 0, 2]
    calls = iter([False, False, True])  # done() after two rounds: two pieces of 2 blocks
    early = mover.digest_while(_Session(), ids, key, lambda: next(calls))
    assert early == block_digests(local.layout, KVGroup.SELF, ids[:4], key)
    assert mover.digest_while(_Session(staging=object()), ids, key, lambda: False) == []
    # the write takes the known ones as given (a marker here) and digests the rest itself
    marker = bytes(16)
    known = [marker, early[1], None, None, None]
    _, digests = mover.write(_Session(), ids, [0, 1, 2, 3, 4], b"stored", key, known=known)
    assert digests[0] == marker
    assert digests[1:] == block_digests(local.layout, KVGroup.SELF, ids[1:], key)
    assert pool.calls[-1][2] == b"stored"


def test_an_unverified_load_is_one_read(setup: Any) -> None:
    mover, pool, _ = setup
    bad, _ = mover.read(_Session(), [0, 1, 2, 3, 4], [4, 3, 2, 1, 0], None)
    assert bad == [] and [blocks for _, blocks, *_ in pool.calls] == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("fail_on", [0, 1])
def test_a_failed_read_piece_raises_and_nothing_is_left_running(setup: Any, fail_on: int) -> None:
    mover, pool, local = setup
    pool.fail_on = fail_on
    key = new_key()
    digests = [
        (key, d, ALGO_XXH3) for d in block_digests(local.layout, KVGroup.SELF, range(5), key)
    ]
    with pytest.raises(TransferError, match="read failed"):
        mover.read(_Session(), [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], digests)
    # the piece after the failed one may have been posted; none after that, none still running
    assert len(pool.calls) <= fail_on + 2
    mover.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-offload-move")]


def test_close_stops_the_helper_thread(setup: Any) -> None:
    mover, _, _ = setup
    mover.write(_Session(), [0, 1, 2], [0, 1, 2], b"n", new_key())
    assert [t for t in threading.enumerate() if t.name.startswith("kvbridge-offload-move")]
    mover.close()
    mover.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-offload-move")]


def test_a_store_writes_no_piece_before_its_digest_and_nothing_after_a_failed_one(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mover, pool, _ = setup
    digested: list[list[int]] = []
    real = moves.block_digests

    def digests(layout: KVLayout, group: KVGroup, ids: list[int], *a: Any) -> list[bytes]:
        # each piece's WRITE waits for its digest: none of this piece was written yet
        assert not set(ids) & {b for op, blocks, *_ in pool.calls for b in blocks}
        if len(digested) == 1:
            raise ValueError("digest failed (test)")
        digested.append(list(ids))
        return real(layout, group, ids, *a)

    monkeypatch.setattr(moves, "block_digests", digests)
    with pytest.raises(ValueError, match="digest failed"):
        mover.write(_Session(), [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], b"stored", new_key())
    # the first piece, digested, may have been written; not the second, nor the notification
    assert [(op, blocks, note) for op, blocks, note, _ in pool.calls] in (
        [],
        [("write", [0, 1], None)],
    )
    mover.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-offload-move")]


def test_a_failed_write_piece_raises_and_the_last_piece_never_notifies(setup: Any) -> None:
    mover, pool, _ = setup
    pool.fail_on = 1
    with pytest.raises(TransferError, match="write failed"):
        mover.write(_Session(), [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], b"stored", new_key())
    assert [(op, blocks, note) for op, blocks, note, _ in pool.calls] == [
        ("write", [0, 1], None),
        ("write", [2, 3], None),
    ]

"""The ``Transport`` contract every backend's real-process tests share.

Not collected itself (the name does not start with ``test_``): each backend's test module
subclasses :class:`TransportContract` as a ``Test...`` class, sets the class attributes where
its behaviour differs (error messages, deadlines, environment), and provides a module-scoped
``pair`` fixture from :func:`open_pair`.
"""

from __future__ import annotations

import random
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest

from tests.harness.peer import PeerError, PeerProc, start_peers

TINY_BLOCKS = 16
SHARE_BLOCKS = 4
# memories each side registers, in order (index = "mem" in the peer protocol)
TARGET_MEMS = [
    ("tiny", TINY_BLOCKS, "block-nhd"),
    ("tiny", TINY_BLOCKS, "layer-nhd"),
    ("kv-share-third", SHARE_BLOCKS, "layer-nhd"),
    ("kv-share-third", SHARE_BLOCKS, "block-nhd"),
    ("tiny", TINY_BLOCKS, "block-hnd"),
]
READER_MEMS = TARGET_MEMS[:4]
# what a peer's log may not contain after a clean close, per backend
LEAK = {
    "nixl": re.compile(r"not returned to mpool|were not flushed|leak", re.IGNORECASE),
}
LINKED_BLOCKS = 64


def assert_clean_close(peer: PeerProc, *, check_log: bool = True) -> None:
    state = peer.close()
    assert state["pending"] == 0 and state["leaked"] == 0, state
    if check_log:
        assert not LEAK[peer.backend].findall(peer.log()), peer.log()[-2000:]


def setup_mems(peer: PeerProc, mems: list[tuple[str, int, str]], seed: int) -> list[dict[str, Any]]:
    return [peer.call("setup", preset=p, num_blocks=n, order=o, seed=seed) for p, n, o in mems]


@contextmanager
def open_pair(backend: str) -> Iterator[dict[str, Any]]:
    """A reader and a target, each with the memories above, target metadata loaded; both
    closed cleanly on a normal exit and stopped whatever happens."""
    reader, target = start_peers("reader", "target", backend=backend)
    try:
        tmems = setup_mems(target, TARGET_MEMS, seed=1)
        rmems = setup_mems(reader, READER_MEMS, seed=2)
        metadata = target.call("metadata")["metadata"]
        yield {"reader": reader, "target": target, "tmems": tmems, "rmems": rmems, "md": metadata}
        assert_clean_close(reader)
        assert_clean_close(target)
    finally:
        reader.stop()
        target.stop()


def connect(
    pair: dict[str, Any], rmem: int, tmem: int, reader: PeerProc | None = None
) -> dict[str, Any]:
    return (reader or pair["reader"]).call(
        "connect",
        peer="target",
        metadata=pair["md"],
        layout=pair["tmems"][tmem]["layout"],
        mem=rmem,
    )


def blocks(peer: PeerProc, mem: int, ids: list[int]) -> list[bytes]:
    result: list[bytes] = peer.call("blocks", mem=mem, ids=ids)["blocks"]
    return result


def transfer(
    reader: PeerProc,
    kind: str,
    link: int,
    local: list[int],
    remote: list[int],
    timeout_s: float = 10.0,
    **kwargs: Any,
) -> Any:
    return reader.call(
        "transfer",
        kind=kind,
        link=link,
        local_ids=local,
        remote_ids=remote,
        timeout_s=timeout_s,
        **kwargs,
    )


def linked(reader: PeerProc, target: PeerProc) -> int:
    """A link from ``reader`` to fresh ``LINKED_BLOCKS``-block memory on ``target``, used once."""
    t = target.call("setup", preset="tiny", num_blocks=LINKED_BLOCKS, order="block-nhd", seed=3)
    r = reader.call("setup", preset="tiny", num_blocks=LINKED_BLOCKS, order="block-nhd", seed=4)
    link: int = reader.call(
        "connect", peer=target.name, metadata=t["metadata"], layout=t["layout"], mem=r["mem"]
    )["link"]
    everything = list(range(LINKED_BLOCKS))
    transfer(reader, "read", link, everything, everything)
    return link


def assert_fails_within(reader: PeerProc, link: int, timeout_s: float, error: str) -> None:
    """A whole-memory read on ``link`` fails with ``error`` within ``timeout_s`` (+1 s), holds
    nothing afterwards, and leaves the link down."""
    everything = list(range(LINKED_BLOCKS))
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=error):
        transfer(
            reader, "read", link, everything, everything, timeout_s, rpc_timeout=timeout_s + 10
        )
    assert time.monotonic() - t0 < timeout_s + 1.0
    state = reader.call("state")
    assert (state["pending"], state["leaked"], state["dlists"]) == (0, 0, 0), state
    assert state["links_down"] == 1
    with pytest.raises(PeerError, match=r"LinkDownError: .* is down"):
        transfer(reader, "read", link, [0], [0], 1)


def receive_notifications(target: PeerProc, count: int, within_s: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + within_s
    while len(got) < count and time.monotonic() < deadline:
        got += target.call("notifications", wait_s=1.0)["notifications"].get("reader", [])
    return got


class TransportContract:
    """What every transport backend must do between two real processes.

    Subclasses set ``backend`` and the attributes below; the module defines ``pair``
    (``with open_pair(backend) as p: yield p``).
    """

    backend: ClassVar[str]
    # a killed peer: the error the in-flight read ends in, and its deadline
    killed_error: ClassVar[str]
    killed_timeout_s: ClassVar[float]
    # set where the backend notices a killed peer itself (the read does not run to its deadline)
    killed_detected_within_s: ClassVar[float | None] = None
    # environment of the hung-peer test's processes
    hung_env: ClassVar[dict[str, str]] = {}
    # whether a write's notification is tested too, and whether the owner sees all in send order
    notifies_writes: ClassVar[bool] = False
    notifications_in_order: ClassVar[bool] = True
    # whether the hung-peer test's reader closes with a log free of transport leak warnings
    hung_closes_log_clean: ClassVar[bool] = True

    def move_ids(
        self, kind: str, pattern: str, rmem: int, tmem: int
    ) -> tuple[list[int], list[int]]:
        """Local and remote ids (7 each) a bit-exact move uses."""
        if pattern == "random":
            rng = random.Random(f"{kind}{rmem}{tmem}")
            return rng.sample(range(TINY_BLOCKS), 7), rng.sample(range(TINY_BLOCKS), 7)
        return self.sequential_ids(kind, rmem, tmem)

    def sequential_ids(self, kind: str, rmem: int, tmem: int) -> tuple[list[int], list[int]]:
        """Adjacent runs on both sides (merged); shifted so a mis-paired block cannot pass."""
        return list(range(2, 9)), list(range(8, 15))

    def check_connected(self, reader: PeerProc, link: dict[str, Any]) -> None:
        """Backend checks on a bit-exact move's freshly connected ``reader``."""

    @pytest.fixture
    def mover(self, pair: dict[str, Any]) -> PeerProc:
        """The reader the bit-exact moves run on."""
        reader: PeerProc = pair["reader"]
        return reader

    @pytest.mark.parametrize("pattern", ["random", "sequential"])
    @pytest.mark.parametrize("kind", ["read", "write"])
    @pytest.mark.parametrize(
        ("rmem", "tmem", "mode", "per_block"),
        [
            (0, 0, "whole_block", 1),
            (1, 1, "per_span", 8),
            (0, 1, "per_span", 8),
            (1, 0, "per_span", 8),
        ],
        ids=["block-block", "layer-layer", "block-layer", "layer-block"],
    )
    def test_every_moved_block_arrives_bit_exact(
        self,
        pair: dict[str, Any],
        mover: PeerProc,
        pattern: str,
        kind: str,
        rmem: int,
        tmem: int,
        mode: str,
        per_block: int,
    ) -> None:
        reader, target = mover, pair["target"]
        link = connect(pair, rmem, tmem, reader)
        self.check_connected(reader, link)
        assert (link["mode"], link["descriptors_per_block"]) == (mode, per_block)
        local_ids, remote_ids = self.move_ids(kind, pattern, rmem, tmem)
        dst, dst_mem, dst_ids = (
            (reader, rmem, local_ids) if kind == "read" else (target, tmem, remote_ids)
        )
        src, src_mem, src_ids = (
            (target, tmem, remote_ids) if kind == "read" else (reader, rmem, local_ids)
        )
        before = blocks(dst, dst_mem, list(range(TINY_BLOCKS)))
        result = transfer(reader, kind, link["link"], local_ids, remote_ids)
        assert result["descriptors"] == 7 * per_block
        assert blocks(dst, dst_mem, dst_ids) == blocks(src, src_mem, src_ids)
        after = blocks(dst, dst_mem, list(range(TINY_BLOCKS)))
        untouched = [b for b in range(TINY_BLOCKS) if b not in dst_ids]
        assert [after[b] for b in untouched] == [before[b] for b in untouched]
        reader.call("disconnect", link=link["link"])

    @pytest.mark.parametrize(("rmem", "tmem", "regions"), [(2, 2, 16), (3, 3, 1), (3, 2, 16)])
    def test_kv_sharing_layout_registers_and_moves_no_aliased_layer_twice(
        self, pair: dict[str, Any], rmem: int, tmem: int, regions: int
    ) -> None:
        # kv-share-third: 24 layers, the last 8 alias earlier ones -> 16 owning layers
        assert pair["tmems"][tmem]["regions"] == regions
        reader, target = pair["reader"], pair["target"]
        link = connect(pair, rmem, tmem)
        result = transfer(reader, "read", link["link"], [3, 0], [1, 2])
        block_bytes = 2 * 16 * 16 * 8 * 128 * 2  # K/V x owning layers x tokens x heads x C x bf16
        assert result["nbytes"] == 2 * block_bytes
        assert result["descriptors"] == 2 * (1 if link["mode"] == "whole_block" else 32)
        assert blocks(reader, rmem, [3, 0]) == blocks(target, tmem, [1, 2])
        reader.call("disconnect", link=link["link"])

    def test_bad_ids_are_rejected_before_the_wire_and_the_link_survives(
        self, pair: dict[str, Any]
    ) -> None:
        reader = pair["reader"]
        link = connect(pair, 0, 0)["link"]

        def read(local_ids: list[int], remote_ids: list[int], **group: str) -> Any:
            return transfer(reader, "read", link, local_ids, remote_ids, 5.0, **group)

        with pytest.raises(PeerError, match=r"LayoutError: block id 16 of group 'self' is outside"):
            read([0], [TINY_BLOCKS])
        with pytest.raises(PeerError, match=r"LayoutError: block id -1 "):
            read([-1], [0])
        with pytest.raises(PeerError, match=r"TransferError: local_ids has 2 ids and remote_ids 1"):
            read([0, 1], [0])
        with pytest.raises(PeerError, match=r"LayoutError: .*group 'cross'"):
            read([0], [0], group="cross")
        assert reader.call("state")["links_down"] == 0
        assert read([2], [5])["nbytes"] > 0
        reader.call("disconnect", link=link)

    def test_incompatible_or_rearranged_layouts_fail_at_connect(self, pair: dict[str, Any]) -> None:
        with pytest.raises(PeerError, match=r"IncompatibleLayoutError: incompatible: model.name"):
            connect(pair, 0, 2)
        with pytest.raises(PeerError, match=r"IncompatibleLayoutError: rearrange: inner order"):
            connect(pair, 0, 4)

    def test_reader_notification_reaches_the_owner(self, pair: dict[str, Any]) -> None:
        reader, target = pair["reader"], pair["target"]
        target.call("notifications")  # drain
        link = connect(pair, 0, 0)["link"]
        transfer(reader, "read", link, [1], [1], 5.0, notify=b"req-7 done")
        reader.call("notify", link=link, message=b"req-8 release")
        sent = [b"req-7 done", b"req-8 release"]
        if self.notifies_writes:
            transfer(reader, "write", link, [2], [3], 5.0, notify=b"req-9 stored")
            sent.append(b"req-9 stored")
        got = receive_notifications(target, len(sent))
        if self.notifications_in_order:
            assert got == sent
        else:
            assert sorted(got) == sorted(sent)
        reader.call("disconnect", link=link)

    def test_disconnected_link_rejects_transfers_until_reconnected(
        self, pair: dict[str, Any]
    ) -> None:
        reader = pair["reader"]
        link = connect(pair, 0, 0)["link"]
        reader.call("disconnect", link=link)
        with pytest.raises(PeerError, match=r"LinkDownError: link .* was disconnected"):
            transfer(reader, "read", link, [0], [0], 5.0)
        again = connect(pair, 0, 0)["link"]
        transfer(reader, "read", again, [0], [0], 5.0)
        assert blocks(reader, 0, [0]) == blocks(pair["target"], 0, [0])
        reader.call("disconnect", link=again)

    @pytest.mark.slow
    def test_killed_peer_fails_the_transfer_within_the_deadline(self) -> None:
        reader, target = start_peers("reader-k", "victim", backend=self.backend)
        try:
            link = linked(reader, target)
            target.signal(signal.SIGKILL)
            target.child.wait(timeout=10)
            t0 = time.monotonic()
            assert_fails_within(reader, link, self.killed_timeout_s, self.killed_error)
            if self.killed_detected_within_s is not None:
                # detected, not timed out
                assert time.monotonic() - t0 < self.killed_detected_within_s
                assert reader.call("state")["peers"] == []
            assert_clean_close(reader)
        finally:
            reader.stop()
            target.stop()

    @pytest.mark.slow
    def test_hung_peer_ends_in_timeout_within_the_deadline(self) -> None:
        reader, target = start_peers("reader-h", "hung", env=self.hung_env, backend=self.backend)
        try:
            link = linked(reader, target)
            target.signal(signal.SIGSTOP)
            assert_fails_within(reader, link, 2.0, r"TransferTimeoutError: READ .* deadline")
            assert_clean_close(reader, check_log=self.hung_closes_log_clean)
        finally:
            reader.stop()
            target.stop()

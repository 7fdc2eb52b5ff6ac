"""The UCXX transport between real processes: bit-exact blocks, peers' requests checked, failures.

Like the NIXL tests, every transport lives in a ``transport_peer.py ... ucxx``
subprocess (the test process loads no UCX), and each test stops its
processes in a ``finally``. The whole module skips when ``ucxx`` is not
installed (it is the optional ``kvbridge[ucxx]`` extra).
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from transport_harness import PeerError, PeerProc, start_peers

from kvbridge.proto.errors import LayoutError, WireError


def _ucxx_importable() -> bool:
    code = "import ucxx._lib.libucxx"
    env = {"UCX_MODULES": "^ib"}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    not _ucxx_importable(), reason="ucxx is not installed (pip install 'kvbridge[ucxx]')"
)

TINY_BLOCKS = 16
SHARE_BLOCKS = 4
TARGET_MEMS = [
    ("tiny", TINY_BLOCKS, "block-nhd"),
    ("tiny", TINY_BLOCKS, "layer-nhd"),
    ("kv-share-third", SHARE_BLOCKS, "layer-nhd"),
    ("kv-share-third", SHARE_BLOCKS, "block-nhd"),
    ("tiny", TINY_BLOCKS, "block-hnd"),
]
READER_MEMS = TARGET_MEMS[:4]
LEAK = re.compile(r"not returned to mpool|were not flushed|leak|unused environment", re.I)


def assert_clean_close(peer: PeerProc) -> None:
    state = peer.close()
    assert state["pending"] == 0 and state["leaked"] == 0, state
    assert not LEAK.findall(peer.log()), peer.log()[-2000:]


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Any]]:
    """A reader and a target, each with the memories above, over UCXX."""
    reader, target = start_peers("reader", "target", backend="ucxx")
    try:
        tmems = [
            target.call("setup", preset=p, num_blocks=n, order=o, seed=1) for p, n, o in TARGET_MEMS
        ]
        rmems = [
            reader.call("setup", preset=p, num_blocks=n, order=o, seed=2) for p, n, o in READER_MEMS
        ]
        metadata = target.call("metadata")["metadata"]
        yield {"reader": reader, "target": target, "tmems": tmems, "rmems": rmems, "md": metadata}
        assert_clean_close(reader)
        assert_clean_close(target)
    finally:
        reader.stop()
        target.stop()


def connect(pair: dict[str, Any], rmem: int, tmem: int) -> dict[str, Any]:
    return pair["reader"].call(
        "connect",
        peer="target",
        metadata=pair["md"],
        layout=pair["tmems"][tmem]["layout"],
        mem=rmem,
    )


def blocks(peer: PeerProc, mem: int, ids: list[int]) -> list[bytes]:
    result: list[bytes] = peer.call("blocks", mem=mem, ids=ids)["blocks"]
    return result


def transfer(reader: PeerProc, kind: str, link: int, local: list[int], remote: list[int]) -> Any:
    return reader.call(
        "transfer", kind=kind, link=link, local_ids=local, remote_ids=remote, timeout_s=10.0
    )


@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("pattern", ["random", "sequential"])
@pytest.mark.parametrize(
    ("rmem", "tmem", "mode", "per_block"),
    [(0, 0, "whole_block", 1), (1, 1, "per_span", 8), (0, 1, "per_span", 8), (1, 0, "per_span", 8)],
    ids=["block-block", "layer-layer", "block-layer", "layer-block"],
)
def test_every_moved_block_arrives_bit_exact(
    pair: dict[str, Any], kind: str, pattern: str, rmem: int, tmem: int, mode: str, per_block: int
) -> None:
    reader, target = pair["reader"], pair["target"]
    link = connect(pair, rmem, tmem)
    assert (link["mode"], link["descriptors_per_block"]) == (mode, per_block)
    rng = random.Random(f"{kind}{pattern}{rmem}{tmem}")
    if pattern == "random":
        local_ids, remote_ids = rng.sample(range(TINY_BLOCKS), 7), rng.sample(range(TINY_BLOCKS), 7)
    else:  # adjacent runs on both sides: merged into few messages
        start = rng.randrange(TINY_BLOCKS - 7)
        local_ids, remote_ids = list(range(start, start + 7)), list(range(7))
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
    pair: dict[str, Any], rmem: int, tmem: int, regions: int
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
    pair: dict[str, Any],
) -> None:
    reader, target = pair["reader"], pair["target"]
    link = connect(pair, 0, 0)["link"]
    served_before = target.call("state")["rejected"]

    def read(local_ids: list[int], remote_ids: list[int], group: str = "self") -> Any:
        return reader.call(
            "transfer",
            kind="read",
            link=link,
            local_ids=local_ids,
            remote_ids=remote_ids,
            timeout_s=5.0,
            group=group,
        )

    with pytest.raises(PeerError, match=r"LayoutError: block id 16 of group 'self' is outside"):
        read([0], [TINY_BLOCKS])
    with pytest.raises(PeerError, match=r"LayoutError: block id -1 "):
        read([-1], [0])
    with pytest.raises(PeerError, match=r"TransferError: local_ids has 2 ids and remote_ids 1"):
        read([0, 1], [0])
    with pytest.raises(PeerError, match=r"LayoutError: .*group 'cross'"):
        read([0], [0], group="cross")
    assert reader.call("state")["links_down"] == 0
    assert target.call("state")["rejected"] == served_before  # nothing reached the target
    assert read([2], [5])["nbytes"] > 0
    reader.call("disconnect", link=link)


def test_incompatible_or_rearranged_layouts_fail_at_connect(pair: dict[str, Any]) -> None:
    with pytest.raises(PeerError, match=r"IncompatibleLayoutError: incompatible: model.name"):
        connect(pair, 0, 2)
    with pytest.raises(PeerError, match=r"IncompatibleLayoutError: rearrange: inner order"):
        connect(pair, 0, 4)


def _read_request(pair: dict[str, Any], tmem: int, **override: Any) -> dict[str, Any]:
    """A well-formed READ request for target memory ``tmem``, with fields overridden."""
    from kvbridge.proto.layout import KVLayout

    layout = KVLayout.from_bytes(pair["tmems"][tmem]["layout"])
    first = layout.regions[0]
    rows = (1).to_bytes(8, "little")
    size = layout.block_bytes().to_bytes(8, "little")  # one whole block
    body = {
        "t": "read",
        "mem": [first.addr, first.length],
        "group": "self",
        "per_span": False,
        "rows": rows,
        "sizes": size,
        "notify": None,
        "timeout_s": 5.0,
    }
    body.update(override)
    return body


def test_malformed_requests_are_refused_and_the_target_keeps_serving(
    pair: dict[str, Any],
) -> None:
    reader, target = pair["reader"], pair["target"]
    link = connect(pair, 0, 0)["link"]
    before = blocks(target, 0, list(range(TINY_BLOCKS)))
    rejected = target.call("state")["rejected"]
    i8 = lambda *v: b"".join(int(x).to_bytes(8, "little", signed=True) for x in v)  # noqa: E731
    tiny_block = int.from_bytes(_read_request(pair, 0)["sizes"], "little")
    bad = {
        "row past the end": {"rows": i8(TINY_BLOCKS)},
        "negative row": {"rows": i8(-1)},
        "size past the region": {"rows": i8(TINY_BLOCKS - 1), "sizes": i8(2 * tiny_block)},
        "size not a block multiple": {"sizes": i8(tiny_block - 1)},
        "zero size": {"sizes": i8(0)},
        "ragged arrays": {"rows": i8(1, 2), "sizes": i8(tiny_block)},
        "rows not bytes": {"rows": [1]},
        "unknown memory": {"mem": [12345, 678]},
        "unknown group": {"group": "cross"},
        "whole block on layer-separate memory": {"mem": _read_request(pair, 1)["mem"]},
        "timeout out of range": {"timeout_s": -1.0},
        "unknown message": {"t": "erase"},
    }
    for why, override in bad.items():
        for op in ("read", "write"):
            body = _read_request(pair, 0, **override)
            body["t"] = override.get("t", op)
            reply = reader.call("raw_request", link=link, body=body, timeout_s=5.0)["reply"]
            assert reply is not None and reply["ok"] is False, (why, op, reply)
            assert reply["error"], (why, op)
    # no reply address, not msgpack, wrong envelope version: dropped, counted, logged
    reader.call("raw_control", link=link, payload=b"\xc1 not msgpack")
    envelope = {"v": 99, "kind": "ucxx-ctrl", "body": {"t": "read", "from": "reader", "xfer": 1}}
    reader.call("raw_control", link=link, payload=msgpack.packb(envelope))
    reader.call("raw_control", link=link, payload=b"")
    deadline = time.monotonic() + 5
    want = rejected + 2 * len(bad) + 3
    while target.call("state")["rejected"] < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert target.call("state")["rejected"] == want
    assert blocks(target, 0, list(range(TINY_BLOCKS))) == before
    # a well-formed request through the same path is served
    ok = reader.call("raw_request", link=link, body=_read_request(pair, 0), timeout_s=5.0)
    assert ok["reply"] == {"ok": True}
    result = transfer(reader, "read", link, [4], [9])
    assert result["nbytes"] > 0 and blocks(reader, 0, [4]) == blocks(target, 0, [9])
    reader.call("disconnect", link=link)


def test_reader_notification_reaches_the_owner(pair: dict[str, Any]) -> None:
    reader, target = pair["reader"], pair["target"]
    target.call("notifications")  # drain
    link = connect(pair, 0, 0)["link"]
    reader.call(
        "transfer",
        kind="read",
        link=link,
        local_ids=[1],
        remote_ids=[1],
        timeout_s=5.0,
        notify=b"req-7 done",
    )
    reader.call("notify", link=link, message=b"req-8 release")
    reader.call(
        "transfer",
        kind="write",
        link=link,
        local_ids=[2],
        remote_ids=[3],
        timeout_s=5.0,
        notify=b"req-9 stored",
    )
    got: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        got += target.call("notifications", wait_s=1.0)["notifications"].get("reader", [])
    assert sorted(got) == [b"req-7 done", b"req-8 release", b"req-9 stored"]
    reader.call("disconnect", link=link)


def test_disconnected_link_rejects_transfers_until_reconnected(pair: dict[str, Any]) -> None:
    reader = pair["reader"]
    link = connect(pair, 0, 0)["link"]
    reader.call("disconnect", link=link)
    with pytest.raises(PeerError, match=r"LinkDownError: link .* was disconnected"):
        transfer(reader, "read", link, [0], [0])
    again = connect(pair, 0, 0)["link"]
    transfer(reader, "read", again, [0], [0])
    assert blocks(reader, 0, [0]) == blocks(pair["target"], 0, [0])
    reader.call("disconnect", link=again)


def _linked(reader: PeerProc, target: PeerProc) -> int:
    t = target.call("setup", preset="tiny", num_blocks=64, order="block-nhd", seed=3)
    r = reader.call("setup", preset="tiny", num_blocks=64, order="block-nhd", seed=4)
    link: int = reader.call(
        "connect", peer=target.name, metadata=t["metadata"], layout=t["layout"], mem=r["mem"]
    )["link"]
    everything = list(range(64))
    transfer(reader, "read", link, everything, everything)
    return link


def _assert_fails_within(reader: PeerProc, link: int, timeout_s: float, error: str) -> None:
    everything = list(range(64))
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=error):
        reader.call(
            "transfer",
            kind="read",
            link=link,
            local_ids=everything,
            remote_ids=everything,
            timeout_s=timeout_s,
            rpc_timeout=timeout_s + 10,
        )
    assert time.monotonic() - t0 < timeout_s + 1.0
    state = reader.call("state")
    assert (state["pending"], state["leaked"], state["dlists"]) == (0, 0, 0), state
    assert state["links_down"] == 1
    with pytest.raises(PeerError, match=r"LinkDownError: .* is down"):
        reader.call("transfer", kind="read", link=link, local_ids=[0], remote_ids=[0], timeout_s=1)


@pytest.mark.slow
def test_killed_peer_ends_in_link_down_well_before_the_deadline() -> None:
    reader, target = start_peers("reader-k", "victim", backend="ucxx")
    try:
        link = _linked(reader, target)
        target.signal(signal.SIGKILL)
        target.proc.wait(timeout=10)
        t0 = time.monotonic()
        _assert_fails_within(reader, link, 5.0, r"LinkDownError: READ .*disconnected")
        assert time.monotonic() - t0 < 2.5  # detected, not timed out
        assert reader.call("state")["peers"] == []
        assert_clean_close(reader)
    finally:
        reader.stop()
        target.stop()


@pytest.mark.slow
def test_hung_peer_ends_in_timeout_within_the_deadline() -> None:
    reader, target = start_peers("reader-h", "hung", backend="ucxx")
    try:
        link = _linked(reader, target)
        target.signal(signal.SIGSTOP)
        _assert_fails_within(reader, link, 2.0, r"TransferTimeoutError: READ .* deadline")
        assert_clean_close(reader)
    finally:
        reader.stop()
        target.stop()


def test_wire_checks_refuse_runs_outside_the_targets_own_memory() -> None:
    import numpy as np

    from kvbridge.worker import ucxx_wire as wire

    table = np.array([[1000 + 100 * i, 100, 0] for i in range(4)], dtype=np.uint64)
    bounds = np.array([[1000, 1400]], dtype=np.uint64)

    def i8(*v: int) -> bytes:
        return np.array(v, dtype="<i8").tobytes()

    assert wire.check_runs(table, bounds, i8(0, 2), i8(200, 200)) == [(1000, 200), (1200, 200)]
    for rows, sizes in [(i8(4), i8(100)), (i8(3), i8(200)), (i8(0), i8(50)), (i8(0), i8(-100))]:
        with pytest.raises(WireError):
            wire.check_runs(table, bounds, rows, sizes)
    # two regions: a run may not cross from one into the next even when they touch
    bounds2 = np.array([[1000, 1200], [1200, 1400]], dtype=np.uint64)
    with pytest.raises(WireError, match="ends outside its region"):
        wire.check_runs(table, bounds2, i8(1), i8(200))
    with pytest.raises(WireError):
        wire.check_runs(table, bounds, [0], [100])


def test_runs_merge_only_what_is_adjacent_on_both_sides() -> None:
    import numpy as np

    from kvbridge.worker import ucxx_wire as wire

    local = np.array([[100 * i, 100, 0] for i in range(8)], dtype=np.uint64)
    remote = np.array([[5000 + 100 * i, 100, 0] for i in range(8)], dtype=np.uint64)
    rows = lambda *v: np.array(v, dtype=np.int32)  # noqa: E731
    plan = wire.plan_runs(local, remote, rows(2, 3, 4, 0), rows(5, 6, 7, 1), coalesce=True)
    assert plan.local_addrs.tolist() == [0, 200]
    assert plan.remote_rows.tolist() == [1, 5] and plan.sizes.tolist() == [100, 300]
    broken = wire.plan_runs(local, remote, rows(2, 3), rows(6, 5), coalesce=True)
    assert broken.sizes.tolist() == [100, 100]
    single = wire.plan_runs(local, remote, rows(2, 3), rows(5, 6), coalesce=False)
    assert len(single) == 2


def test_device_tensors_are_refused_as_host_only() -> None:
    import torch

    from kvbridge.worker.ucxx_transport import check_host_memory

    check_host_memory({"l0": torch.zeros(4)})
    with pytest.raises(LayoutError, match="UCXX transport here is host-only"):
        check_host_memory({"l0": torch.zeros(4), "l1": torch.zeros(4, device="meta")})


def test_config_names_the_bad_knob() -> None:
    from kvbridge.proto.errors import ConfigError
    from kvbridge.worker.ucxx_transport import UcxxConfig

    with pytest.raises(ConfigError, match="idle_wait_s"):
        UcxxConfig("a", idle_wait_s=0)
    with pytest.raises(ConfigError, match="name"):
        UcxxConfig("")
    with pytest.raises(ConfigError, match="max_message_bytes"):
        UcxxConfig("a", max_message_bytes=10)


def test_importing_the_transport_loads_no_ucxx_or_torch() -> None:
    code = (
        "import sys, kvbridge.worker.ucxx_transport, kvbridge.worker.ucxx_wire;"
        "bad = [m for m in sys.modules if m.startswith(('ucxx', 'torch', 'nixl', 'rmm'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

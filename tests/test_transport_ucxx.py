"""The UCXX transport between real processes: bit-exact blocks, peers' requests checked, failures.

Like the NIXL tests, every transport lives in a ``tests.harness.transport_peer ... ucxx``
subprocess (the test process loads no UCX), and each test stops its
processes in a ``finally``. The whole module skips when ``ucxx`` is not
installed (it is the optional ``kvbridge[ucxx]`` extra).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from kvbridge.proto import LayoutError, WireError
from tests.harness.fresh import assert_importing_loads_none_of
from tests.harness.transport_contract import (
    TINY_BLOCKS,
    TransportContract,
    blocks,
    connect,
    open_pair,
    transfer,
)


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


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Any]]:
    """A reader and a target over UCXX (see transport_contract.open_pair)."""
    with open_pair("ucxx") as p:
        yield p


class TestUcxxTransport(TransportContract):
    """The transport contract over UCXX."""

    backend = "ucxx"
    killed_error = r"LinkDownError: READ .*disconnected"
    killed_timeout_s = 5.0
    killed_detected_within_s = 2.5  # UCXX sees the endpoint close; the read does not time out
    notifies_writes = True
    notifications_in_order = False

    def sequential_ids(self, kind: str, rmem: int, tmem: int) -> tuple[list[int], list[int]]:
        """Adjacent runs on both sides, merged into few messages; the local run starts at random."""
        start = random.Random(f"{kind}sequential{rmem}{tmem}").randrange(TINY_BLOCKS - 7)
        return list(range(start, start + 7)), list(range(7))


def _read_request(pair: dict[str, Any], tmem: int, **override: Any) -> dict[str, Any]:
    """A well-formed READ request for target memory ``tmem``, with fields overridden."""
    from kvbridge.proto import KVLayout

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


def test_wire_checks_refuse_runs_outside_the_targets_own_memory() -> None:
    import numpy as np

    from kvbridge.connector.transport.ucxx import wire

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

    from kvbridge.connector.transport.ucxx import wire

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

    from kvbridge.connector.transport.ucxx.transport import check_host_memory

    check_host_memory({"l0": torch.zeros(4)})
    with pytest.raises(LayoutError, match="UCXX transport here is host-only"):
        check_host_memory({"l0": torch.zeros(4), "l1": torch.zeros(4, device="meta")})


def test_config_names_the_bad_knob() -> None:
    from kvbridge.connector.transport.ucxx import UcxxConfig
    from kvbridge.proto import ConfigError

    with pytest.raises(ConfigError, match="idle_wait_s"):
        UcxxConfig("a", idle_wait_s=0)
    with pytest.raises(ConfigError, match="name"):
        UcxxConfig("")
    with pytest.raises(ConfigError, match="max_message_bytes"):
        UcxxConfig("a", max_message_bytes=10)


def test_importing_the_transport_loads_no_ucxx_or_torch() -> None:
    assert_importing_loads_none_of(
        ["kvbridge.connector.transport.ucxx.transport", "kvbridge.connector.transport.ucxx.wire"],
        ("ucxx", "torch", "nixl", "rmm"),
    )

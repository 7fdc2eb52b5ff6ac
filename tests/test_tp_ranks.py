"""Tensor parallelism without vLLM: which port each rank dials, and whom it may read from.

A request names only the prefill's rank-0 control address. A decode rank ``r``
checks that address against the allowed peers first, then derives rank ``r``'s
port itself (rank-0 port + ``r``), and reads only from a peer that proves in the
handshake to be rank ``r`` of the same TP size: any other rank holds other KV
heads. Real control servers on loopback gRPC; the transport is a stand-in that
counts links.

Heterogeneous TP (one size a multiple ``k`` of the other) pairs head slices of
vLLM's packed head-major pages: which remote ranks a rank reads, what the
handshake must show, that the slice tables pair span for span (real NIXL, bytes
compared), and that the owner frees a lease read by ``k`` ranks once all ``k``
released it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connector import BlockLoad, ConnectorConfig, KVTransferParams, ServerOptions
from kvbridge.connector.control import (
    ControlServer,
    ControlServerConfig,
    Role,
    serve,
)
from kvbridge.connector.control.peers import (
    dial_control,
    nixl_agent_name,
    rank_address,
    rank_port,
)
from kvbridge.connector.control.releases import ReleaseListener, parse_release, release_message
from kvbridge.connector.control.seal import SEAL_WAIT_S
from kvbridge.connector.load import LinkCache
from kvbridge.connector.transport import LocalMemory
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.scheduler import VllmScheduler, from_json_params
from kvbridge.connector.vllm.worker import WorkerSettings
from kvbridge.proto import (
    BlockId,
    ConfigError,
    IncompatibleLayoutError,
    KVLayout,
    PeerError,
    RequestId,
    WireError,
    preset_layout,
)
from kvbridge.proto.negotiate import (
    HEAD_MAJOR_SUFFIX,
    TransferMode,
    head_slices,
    negotiate,
    source_ranks,
)
from tests.harness.control import FakeOwner, peer
from tests.harness.grpc_fakes import RecordingServer

ENGINE = "prefill-a"


class LinkCounter:
    """Stands in for the transport: records the engines it linked to."""

    def __init__(self) -> None:
        self.connected: list[str] = []

    def connect(self, engine: str, metadata: bytes, layout: KVLayout, target: object) -> object:
        self.connected.append(engine)
        return object()

    def disconnect(self, link: object) -> None:
        pass


def _layout(rank: int, size: int = 2) -> KVLayout:
    return preset_layout("tiny", num_blocks=16, tp_rank=rank, tp_size=size)


# ----- the rank's port -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rank0", "rank", "expected"),
    [
        ("127.0.0.1:7600", 0, "127.0.0.1:7600"),
        ("127.0.0.1:7600", 1, "127.0.0.1:7601"),
        ("Prefill.Example:7600", 3, "prefill.example:7603"),
        ("[0:0:0:0:0:0:0:1]:7600", 1, "[::1]:7601"),
    ],
)
def test_rank_r_serves_at_the_rank_zero_port_plus_r(rank0: str, rank: int, expected: str) -> None:
    assert rank_address(rank0, rank) == expected


def test_a_rank_port_past_65535_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="one port per rank"):
        rank_port(65535, 1)
    with pytest.raises(ConfigError, match="one port per rank"):  # checked at start-up
        WorkerSettings("m", 32, control_port=65534, tp_rank=0, tp_size=4)
    with pytest.raises(PeerError, match="no TP rank 2 control address"):
        rank_address("127.0.0.1:65534", 2)


# ----- the allowlist names rank 0, and is checked first ------------------------------------
def test_the_advertised_address_is_checked_before_the_rank_port_is_derived() -> None:
    with RecordingServer() as recorder:
        host, port = recorder.address.rsplit(":", 1)
        below = f"{host}:{int(port) - 1}"
        # only the recorder's own address is allowed; a request naming the port below it
        # would derive exactly that address for rank 1, but it is refused before deriving
        config = ConnectorConfig("decode-x", token="t", allowed_peers=(recorder.address,))
        with pytest.raises(PeerError, match="not in the allowed peers"):
            dial_control(below, config, tp_rank=1)
        assert recorder.calls == []  # nothing was sent, the token included


def test_rank_r_dials_the_port_it_derived_not_one_from_the_request() -> None:
    config = ConnectorConfig("decode-x", allowed_peers=("10.0.0.1:7600",))
    client = dial_control("10.0.0.1:7600", config, tp_rank=1)
    try:
        assert client.address == "10.0.0.1:7601"
    finally:
        client.close()


# ----- the handshake proves the rank -------------------------------------------------------
def _free_port_pair() -> int:
    """A port ``p`` with ``p + 1`` free too (a two-rank prefill's control ports)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return int(p)
    raise RuntimeError("no two free consecutive ports")


def _prefill(stack: ExitStack, layout: KVLayout, port: int) -> ControlServer:
    config = ControlServerConfig(listen=ServerOptions(port=port))
    server = serve(peer(layout, ENGINE, Role.PREFILL), FakeOwner(layout), config)
    stack.callback(server.close)
    return server


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def _reader(stack: ExitStack, layout: KVLayout) -> tuple[LinkCache, LinkCounter]:
    counter = LinkCounter()
    config = ConnectorConfig("decode-0", control_timeout_s=5.0)
    cache = LinkCache(
        counter,  # type: ignore[arg-type]
        lambda address, rank: dial_control(address, config, rank),
        lambda local: peer(local, "decode-0", Role.DECODE),
        LocalMemory(1, layout, "cpu"),
        {},
        None,  # type: ignore[arg-type]  # these peers publish no seal table
        handshake_wait_s=20.0,
    )
    stack.callback(cache.close)
    return cache, counter


def _load(rank0: str, tp_size: int = 2) -> BlockLoad:
    ids = {"self": (BlockId(0),)}
    return BlockLoad(RequestId("r1"), ENGINE, rank0, ids, ids, remote_tp_size=tp_size)


def test_each_decode_rank_links_to_the_same_rank_of_the_prefill(stack: ExitStack) -> None:
    port = _free_port_pair()
    servers = [_prefill(stack, _layout(r), port + r) for r in (0, 1)]
    rank0 = servers[0].address
    for r in (0, 1):
        cache, counter = _reader(stack, _layout(r))
        got, _ = cache.get(_load(rank0), r)
        assert got.address == rank0  # cached under the address the request named
        assert got.client.address == servers[r].address
        assert counter.connected == [nixl_agent_name(ENGINE, r, 2)]  # each rank's own agent


def test_a_peer_of_another_rank_is_refused_at_the_handshake(stack: ExitStack) -> None:
    port = _free_port_pair()
    # miswired prefill: rank 0's layout serves at rank 1's port
    _prefill(stack, _layout(0), port)
    _prefill(stack, _layout(0), port + 1)
    cache, counter = _reader(stack, _layout(1))
    with pytest.raises(PeerError, match=r"TP rank 0 of 2; this worker \(TP rank 1 of 2\)"):
        cache.get(_load(f"127.0.0.1:{port}"), 1)
    assert counter.connected == []


def test_a_peer_of_another_tp_size_is_refused_at_the_handshake(stack: ExitStack) -> None:
    port = _free_port_pair()
    _prefill(stack, _layout(0, size=1), port)
    cache, counter = _reader(stack, _layout(0))
    with pytest.raises(IncompatibleLayoutError, match="tp_size differs"):
        cache.get(_load(f"127.0.0.1:{port}"))
    assert counter.connected == []


# ----- kv_transfer_params carry the prefill's TP size --------------------------------------
BS = 4
PROMPT = list(range(1, 19))


def _scheduler(role: str, tp_size: int) -> VllmScheduler:
    extra: dict[str, object] = {"control_port": 7600} if role == "kv_producer" else {}
    cfg = VllmConnectorConfig.from_vllm(role, f"engine-{role}", extra, model="tiny")
    hasher = cfg.hasher(dtype="float32", num_layers=2, num_kv_heads=2, head_size=8, block_size=BS)
    return VllmScheduler(cfg.connector, BS, hasher, None, tp_size)


def _handed_over(tp_size: int) -> dict[str, object]:
    prefill = _scheduler("kv_producer", tp_size)
    ids = [BlockId(b) for b in range(5)]
    _, params = prefill.request_finished(
        RequestId("p1"), PROMPT, {"do_remote_decode": True}, ids, True
    )
    assert params is not None
    return params


def test_a_prefill_advertises_its_tp_size_and_rank_zero_address() -> None:
    params = _handed_over(2)
    assert params["tp_size"] == 2 and params["remote_address"] == "127.0.0.1:7600"
    decode = _scheduler("kv_consumer", 2)
    assert decode.num_matched(RequestId("d1"), PROMPT, params, 0) == (len(PROMPT), True)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_heterogeneous_tp_plans_a_load_naming_the_prefill_tp_size(
    prefill_tp: int, decode_tp: int
) -> None:
    params = _handed_over(prefill_tp)
    decode = _scheduler("kv_consumer", decode_tp)
    assert decode.num_matched(RequestId("d1"), PROMPT, params, 0) == (len(PROMPT), True)
    decode.after_alloc(RequestId("d1"), PROMPT, [BlockId(b) for b in range(5)], len(PROMPT))
    (load,) = decode.build_step()[0].loads
    assert load.remote_tp_size == prefill_tp


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 3), (3, 2)])
def test_tp_sizes_neither_dividing_the_other_recompute_with_a_clear_log_line(
    prefill_tp: int, decode_tp: int, caplog: pytest.LogCaptureFixture
) -> None:
    params = _handed_over(prefill_tp)
    decode = _scheduler("kv_consumer", decode_tp)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        assert decode.num_matched(RequestId("d1"), PROMPT, params, 0) == (0, False)
    expected = f"prefill TP={prefill_tp}, decode TP={decode_tp}: neither TP size divides"
    assert expected in caplog.text
    assert decode.build_step()[0].loads == ()


def test_params_without_tp_size_are_from_a_tp1_prefill() -> None:
    params = _handed_over(1)
    del params["tp_size"]
    raw = from_json_params(params)
    assert raw is not None
    assert KVTransferParams.parse(raw, BS).tp_size == 1


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", 4096])
def test_a_bad_tp_size_in_params_is_a_wire_error(bad: object) -> None:
    params = _handed_over(1)
    params["tp_size"] = bad
    raw = from_json_params(params)
    assert raw is not None
    with pytest.raises(WireError, match="tp_size"):
        KVTransferParams.parse(raw, BS)


# ----- heterogeneous TP: head slices -------------------------------------------------------
def _packed(rank: int, size: int, order: str = "layer-nhd", heads: int = 2) -> KVLayout:
    """A vLLM-like packed head-major layout (the suffix ``views.py`` gives its pages)."""
    layout = preset_layout("tiny", num_blocks=4, order=order)
    name = layout.model.name + HEAD_MAJOR_SUFFIX
    model = dataclasses.replace(layout.model, name=name, num_kv_heads=heads)
    return dataclasses.replace(layout, model=model, tp_rank=rank, tp_size=size)


@pytest.mark.parametrize(
    ("rank", "size", "remote_size", "expected"),
    [(0, 2, 1, [0]), (1, 2, 1, [0]), (3, 4, 2, [1]), (0, 1, 2, [0, 1]), (1, 2, 4, [2, 3])],
)
def test_a_rank_reads_the_remote_ranks_holding_its_heads(
    rank: int, size: int, remote_size: int, expected: list[int]
) -> None:
    assert source_ranks(rank, size, remote_size) == expected


def test_only_packed_head_major_pages_negotiate_head_slices() -> None:
    assert negotiate(_packed(1, 2), _packed(0, 1)).mode is TransferMode.HEAD_SLICE
    assert negotiate(_packed(0, 1), _packed(1, 2, "block-nhd")).mode is TransferMode.HEAD_SLICE
    # kvbridge's own pages are K-major: a head slice is two spans
    plain = negotiate(_layout(1), _layout(0, size=1))
    assert plain.mode is TransferMode.INCOMPATIBLE and "is not one span" in plain.reason
    # a page whose halves are apart (KV outermost) is not one span either
    apart = negotiate(_packed(0, 2, "layer-kv-nhd"), _packed(0, 1, "layer-kv-nhd"))
    assert apart.mode is TransferMode.INCOMPATIBLE and "not one span" in apart.reason
    with pytest.raises(IncompatibleLayoutError, match="takes its heads from rank 1 of 2"):
        head_slices(_packed(3, 4, heads=4), _packed(0, 2, heads=4))
    assert head_slices(_packed(3, 4, heads=4), _packed(1, 2, heads=4)) == ((0, 1), (1, 2))
    assert head_slices(_packed(1, 2, heads=4), _packed(3, 4, heads=4)) == ((1, 2), (0, 1))
    with pytest.raises(IncompatibleLayoutError, match="holds none of the heads"):
        head_slices(_packed(0, 2, heads=4), _packed(2, 4, heads=4))
    ratio = negotiate(_packed(0, 2, heads=6), _packed(0, 3, heads=6))
    assert ratio.mode is TransferMode.INCOMPATIBLE and "not a multiple" in ratio.reason


def test_a_tp2_rank_links_to_the_tp1_prefill_and_a_tp1_reader_to_both_ranks(
    stack: ExitStack,
) -> None:
    port = _free_port_pair()
    servers = [_prefill(stack, _packed(r, 2), port + r) for r in (0, 1)]
    rank0 = servers[0].address
    cache, counter = _reader(stack, _packed(0, 1))
    for r in (0, 1):
        got, _ = cache.get(_load(rank0, tp_size=2), r)
        assert got.client.address == servers[r].address and got.rank == r
    assert counter.connected == [f"{ENGINE}-tp0", f"{ENGINE}-tp1"]  # two distinct agents
    # the load claims TP=1, the handshake shows TP=2: refused
    with pytest.raises(PeerError, match="reads rank"):
        _reader(stack, _packed(1, 2))[0].get(_load(rank0, tp_size=1), 0)


def test_a_tp2_reader_refuses_a_rank_it_does_not_read_from(stack: ExitStack) -> None:
    port = _free_port_pair()
    _prefill(stack, _packed(0, 2, heads=4), port)
    _prefill(stack, _packed(1, 2, heads=4), port + 1)
    cache, counter = _reader(stack, _packed(0, 4, heads=4))  # TP=4 rank 0 reads rank 0
    with pytest.raises(PeerError, match=r"reads rank\(s\) \[0\] of 2"):
        cache.get(_load(f"127.0.0.1:{port}"), 1)
    assert counter.connected == []


def _skip_without_nixl() -> None:
    if not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl")):
        pytest.skip("needs NIXL (nixl-cu12 or nixl-cu13)")


@pytest.mark.parametrize("reader_tp", [2, 1])
def test_head_slice_reads_move_each_ranks_heads_byte_for_byte(reader_tp: int) -> None:
    """Real NIXL READs (in a subprocess, as every NIXL agent in these tests): TP=1 -> TP=2
    ranks each get their half of every page; TP=2 ranks -> TP=1 fill its two halves."""
    _skip_without_nixl()
    proc = subprocess.run(
        [sys.executable, "-m", "tests.harness.head_slices", str(reader_tp)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, UCX_MODULES="^ib"),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"pages_compared": 2 * 4 * 3, "mismatched": []}, result


class Notes:
    """Stands in for a transport's notifications: hands out what was queued."""

    def __init__(self) -> None:
        self.queue: list[bytes] = []
        self.lock = threading.Lock()

    def poll_notifications(self) -> dict[str, list[bytes]]:
        with self.lock:
            out, self.queue = self.queue, []
        return {"decode": out} if out else {}


def test_a_lease_read_by_k_ranks_is_released_once_all_k_released() -> None:
    notes, released = Notes(), []
    listener = ReleaseListener(notes, released.append)  # type: ignore[arg-type]
    lease_a, lease_b = "a" * 32, "b" * 32
    try:
        with notes.lock:
            notes.queue += [
                release_message(lease_a, 0, 2),
                release_message(lease_a, 0, 2),  # the same reader twice counts once
                release_message(lease_b),  # one reader: at once
                b"kvbridge-release\0" + lease_a.encode() + b"/2/2",  # not a reader of 2
            ]
        deadline = time.monotonic() + 5
        while released != [lease_b] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert released == [lease_b]
        with notes.lock:
            notes.queue.append(release_message(lease_a, 1, 2))
        while len(released) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released == [lease_b, lease_a]
    finally:
        listener.close()
    assert parse_release(release_message(lease_a, 1, 2)) == (lease_a, 1, 2)
    assert parse_release(b"kvbridge-release\0" + b"x" * 32) is None
    with pytest.raises(ValueError, match="not a reader"):
        release_message(lease_a, 2, 2)


class FakeSeals:
    """Stands in for SealReader: each rank's seal holds or not; records releases."""

    def __init__(self, holds: dict[int, bool]) -> None:
        self._holds = holds
        self.released: list[int] = []
        self.calls: list[list[int]] = []
        """The seal links of each holds_all call."""

        self.waits: list[float] = []
        """How long each call was to read again a seal not made yet (SealReader does)."""

    def holds_all(
        self, links: list[int], lease_id: str, digest: bytes, timeout_s: float, wait_s: float = 0
    ) -> list[bool]:
        self.calls.append(list(links))
        self.waits.append(wait_s)
        return [self._holds[link] for link in links]

    def release(self, link: int, lease_id: str, reader: int = 0, readers: int = 1) -> None:
        self.released.append(link)


class FakeLinks:
    """Stands in for LinkCache: a peer per rank whose seal link is the rank."""

    def get(self, load: BlockLoad, rank: int) -> tuple[object, bool]:
        peer = dataclasses.make_dataclass("P", ["rank", "link", "seal_link"])
        return peer(rank, rank, rank), True


def _load_across_ranks(
    load: BlockLoad, holds: dict[int, bool]
) -> tuple[Any, FakeSeals, list[list[int]]]:
    """Run ``load`` across TP ranks 0 and 1 (fake links, seals per ``holds``, READs that
    succeed): ``(result, seals, the links of each READ call)``."""
    from kvbridge.connector.load import ReadFigures, load_from_ranks

    seals = FakeSeals(holds)
    reads: list[list[int]] = []

    def read(requests: list[Any]) -> list[ReadFigures]:
        reads.append([r.link for r in requests])
        return [ReadFigures(len(r.local) * 8, len(r.local), len(r.local), 0.001) for r in requests]

    result = load_from_ranks(
        load,
        [0, 1],
        FakeLinks(),
        seals,
        read,
        1.0,
        lambda e, p: None,  # type: ignore[arg-type]
    )
    return result, seals, reads


@pytest.mark.parametrize(
    ("holds", "seal", "moved", "released"),
    [
        ({0: True, 1: True}, b"s" * 32, 2, [0, 1]),
        ({0: True, 1: False}, b"s" * 32, 0, [0]),  # rank 1 unproven: recompute all
        ({0: True, 1: True}, b"", 0, []),  # no seal in the params: no proof, recompute
    ],
)
def test_a_load_across_ranks_counts_only_if_every_ranks_seal_holds(
    holds: dict[int, bool], seal: bytes, moved: int, released: list[int]
) -> None:
    ids = {"self": (BlockId(4), BlockId(5))}
    load = BlockLoad(RequestId("r"), ENGINE, "a:1", ids, ids, "c" * 32, seal=seal, remote_tp_size=2)
    result, seals, reads = _load_across_ranks(load, holds)
    assert result.blocks_moved == moved and seals.released == released
    assert result.bad_block_ids == (() if moved else ids["self"])
    if seal:  # every rank's slices posted in one go, then every rank's seal in one go
        assert reads == [[0, 1]] and seals.calls == [[0, 1]]
        # a rank that has not sealed yet (a vLLM rank seals its lease a step late) is read
        # again by SealReader.holds_all for a bounded time (test_seal_tag.py)
        assert seals.waits == [SEAL_WAIT_S]


def test_a_load_across_ranks_with_digests_in_the_params_recomputes_not_loads_unverified() -> None:
    ids = {"self": (BlockId(4), BlockId(5))}
    load = BlockLoad(
        RequestId("r"),
        ENGINE,
        "a:1",
        ids,
        ids,
        "c" * 32,
        seal=b"s" * 32,
        remote_tp_size=2,
        digest_key=7,
        digests={"self": (b"d" * 16, b"e" * 16)},
    )
    result, _, reads = _load_across_ranks(load, {0: True, 1: True})
    # one rank's whole-block digests cannot check slices of several: nothing is read, every
    # block recomputed (a vLLM owner keeps per-rank and per-head digests instead)
    assert result.blocks_moved == 0 and result.bad_block_ids == ids["self"] and reads == []
    assert "cannot be verified" in result.error


# ----- verified hand-overs: real NIXL, one process per side -------------------------------
CLEAN = {"moved": 4, "bad": [], "mismatches": 0, "verified": True, "error": "", "wrong": []}
"""A rank's report of a load in which every block came over, byte for byte."""


def _verified_handover(prefill_tp: int, decode_tp: int) -> list[dict[str, Any]]:
    """A vLLM-like prefill of ``prefill_tp`` ranks hands a request over with verification on
    (the default: its digests stay with it); a decode of ``decode_tp`` ranks loads it. Each
    decode rank's report (tests/harness/tp_pair.py)."""
    _skip_without_nixl()
    from tests.harness.tp_pair import Prefill, run_decode

    prefill = Prefill(prefill_tp)
    try:
        assert prefill.params["digest_key"] is not None and prefill.params["digests_at_owner"]
        return run_decode(decode_tp, prefill.params)
    finally:
        prefill.close()


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_a_heterogeneous_tp_load_with_a_digest_key_is_verified_and_loads(
    prefill_tp: int, decode_tp: int
) -> None:
    """A vLLM-like prefill of one TP size hands a request over with verification on (the
    default); a decode of the other reads its head slices and checks them against the
    digests each prefill rank recorded: per head (decode TP bigger) or each rank's whole
    pages (decode TP smaller). Every block loads, byte for byte."""
    ranks = _verified_handover(prefill_tp, decode_tp)
    assert len(ranks) == decode_tp
    for got in ranks:
        assert got.pop("path") in ("sealed", "owner")
        assert got.pop("digests_calls") >= 1, ranks  # head slices: the owner's digests
        assert got == CLEAN, ranks


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_same_tp_verified_load_is_proved_by_its_seal_without_asking_for_digests(
    tp: int,
) -> None:
    """A vLLM-like prefill keeps its digests (they cannot go in the params) and tags its
    lease's seal with them under the hand-over's key; a decode of the same TP size that reads
    every leased block checks what landed against that tag: every block loads, byte for
    byte, on the sealed path, and no ``Digests`` round trip is made."""
    ranks = _verified_handover(tp, tp)
    assert ranks == [{**CLEAN, "path": "sealed", "digests_calls": 0}] * tp, ranks

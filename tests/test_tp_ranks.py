"""Tensor parallelism without vLLM: which port each rank dials, and whom it may read from.

A request names only the prefill's rank-0 control address. A decode rank ``r``
checks that address against the allowed peers first, then derives rank ``r``'s
port itself (rank-0 port + ``r``), and reads only from a peer that proves in the
handshake to be rank ``r`` of the same TP size: any other rank holds other KV
heads. Real control servers on loopback gRPC; the transport is a stand-in that
counts links. A prefill of another TP size is never loaded from (the planner).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kvbridge.connector import BlockLoad, ConnectorConfig, KVTransferParams
from kvbridge.connector.control import ControlServer, ControlServerConfig, Role, serve
from kvbridge.connector.control.peers import dial_control, rank_address, rank_port
from kvbridge.connector.links import LinkCache
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
    config = ControlServerConfig(port=port)
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
        lambda address: dial_control(address, config, layout.tp_rank),
        lambda local: peer(local, "decode-0", Role.DECODE),
        LocalMemory(1, layout, "cpu"),
        {},
        None,  # type: ignore[arg-type]  # these peers publish no seal table
        handshake_wait_s=20.0,
    )
    stack.callback(cache.close)
    return cache, counter


def _load(rank0: str) -> BlockLoad:
    ids = {"self": (BlockId(0),)}
    return BlockLoad(RequestId("r1"), ENGINE, rank0, ids, ids)


def test_each_decode_rank_links_to_the_same_rank_of_the_prefill(stack: ExitStack) -> None:
    port = _free_port_pair()
    servers = [_prefill(stack, _layout(r), port + r) for r in (0, 1)]
    rank0 = servers[0].address
    for r in (0, 1):
        cache, counter = _reader(stack, _layout(r))
        got, _ = cache.get(_load(rank0))
        assert got.address == rank0  # cached under the address the request named
        assert got.client.address == servers[r].address
        assert counter.connected == [ENGINE]


def test_a_peer_of_another_rank_is_refused_at_the_handshake(stack: ExitStack) -> None:
    port = _free_port_pair()
    # miswired prefill: rank 0's layout serves at rank 1's port
    _prefill(stack, _layout(0), port)
    _prefill(stack, _layout(0), port + 1)
    cache, counter = _reader(stack, _layout(1))
    with pytest.raises(PeerError, match="TP rank 0 of 2, this worker is TP rank 1 of 2"):
        cache.get(_load(f"127.0.0.1:{port}"))
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


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_heterogeneous_tp_recomputes_with_a_clear_log_line(
    prefill_tp: int, decode_tp: int, caplog: pytest.LogCaptureFixture
) -> None:
    params = _handed_over(prefill_tp)
    decode = _scheduler("kv_consumer", decode_tp)
    with caplog.at_level(logging.WARNING, logger="kvbridge"):
        assert decode.num_matched(RequestId("d1"), PROMPT, params, 0) == (0, False)
    expected = f"prefill TP={prefill_tp}, decode TP={decode_tp}: heterogeneous TP is not supported"
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

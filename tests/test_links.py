"""The reading engine's link cache: one handshake per new engine, started ahead of its loads.

Real control servers on loopback gRPC (a handshake hook holds or refuses
handshakes and counts them); the transport is a hand-written stand-in that
counts links, since the peers here have no KV memory to connect to.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest

from kvbridge.connector import BlockLoad
from kvbridge.connector.control import ControlClient, ControlServer, PeerInfo, Role, serve
from kvbridge.connector.control.seal import seal_layout
from kvbridge.connector.load import LinkCache, Peer
from kvbridge.connector.transport import LocalMemory
from kvbridge.connector.transport.steps import link_step
from kvbridge.proto import (
    BlockId,
    IncompatibleLayoutError,
    KVLayout,
    Negotiation,
    RequestId,
    TransferTimeoutError,
    preset_layout,
)
from tests.harness.control import FakeOwner, peer

LAYOUT = preset_layout("tiny", num_blocks=16)
WAIT_S = 20.0
"""How long a test waits for something that happens at once when the code is right."""


class LinkCounter:
    """Stands in for the transport: counts links made and dropped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connected: list[str] = []
        self.disconnected = 0

    def connect(self, engine: str, metadata: bytes, layout: KVLayout, target: object) -> object:
        with self.lock:
            self.connected.append(engine)
        return object()

    def disconnect(self, link: object) -> None:
        with self.lock:
            self.disconnected += 1


class WarmCounter:
    """Stands in for the seal reader: links to seal tables through ``links`` and records
    each warm-up READ (which link, and how many links existed when it ran)."""

    def __init__(self, links: LinkCounter, fail: int = 0) -> None:
        self.links = links
        self.fail = fail
        self.warmed: list[tuple[object, int]] = []

    def connect(self, engine: str, metadata: bytes, layout: KVLayout) -> object:
        return self.links.connect(engine, metadata, layout, None)

    def warm(self, link: object, timeout_s: float) -> float:
        if self.fail:
            self.fail -= 1
            raise TransferTimeoutError("warm-up READ refused by the test")
        self.warmed.append((link, len(self.links.connected)))
        return 0.001


@dataclass
class Prefill:
    """A real control server whose handshakes a test can hold, refuse and count."""

    engine: str
    server: ControlServer = field(init=False)
    gate: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Event = field(default_factory=threading.Event)
    refuse: int = 0
    handshakes: int = 0
    seals: bool = False
    """Whether it publishes a lease seal table (its links are then warmed)."""

    def __post_init__(self) -> None:
        self.gate.set()
        info = peer(LAYOUT, self.engine, Role.PREFILL)
        if self.seals:
            info = replace(info, seal_layout=seal_layout(8))
        self.server = serve(info, FakeOwner(LAYOUT), None, self)

    def __call__(self, remote: PeerInfo, negotiation: Negotiation) -> None:
        self.handshakes += 1
        self.arrived.set()
        self.gate.wait(WAIT_S)
        if self.refuse:
            self.refuse -= 1
            raise IncompatibleLayoutError("refused by the test")

    def load(self, rid: str = "r1") -> BlockLoad:
        ids = {"self": (BlockId(0),)}
        return BlockLoad(RequestId(rid), self.engine, self.server.address, ids, ids)


@pytest.fixture
def prefills() -> Iterator[dict[str, Prefill]]:
    started = {name: Prefill(name) for name in ("prefill-a", "prefill-b")}
    yield started
    for p in started.values():
        p.gate.set()
        p.server.close()


def _cache(counter: LinkCounter, seals: WarmCounter | None = None) -> LinkCache:
    return LinkCache(
        counter,  # type: ignore[arg-type]
        lambda address, rank: ControlClient(address, timeout_s=5.0),
        lambda layout: peer(layout, "decode-0", Role.DECODE),
        LocalMemory(1, LAYOUT, "cpu"),
        {},
        seals,  # type: ignore[arg-type]
        max_handshakes=4,
        handshake_wait_s=WAIT_S,
    )


@pytest.fixture
def links() -> Iterator[tuple[LinkCache, LinkCounter]]:
    counter = LinkCounter()
    cache = LinkCache(
        counter,  # type: ignore[arg-type]
        lambda address, rank: ControlClient(address, timeout_s=5.0),
        lambda layout: peer(layout, "decode-0", Role.DECODE),
        LocalMemory(1, LAYOUT, "cpu"),
        {},
        None,  # type: ignore[arg-type]  # these peers publish no seal table
        max_handshakes=4,
        handshake_wait_s=WAIT_S,
    )
    yield cache, counter
    cache.close()
    assert counter.disconnected == len(counter.connected), "a link was left connected"


def _get_in_threads(cache: LinkCache, loads: list[BlockLoad]) -> list[tuple[Peer, bool]]:
    got: list[tuple[Peer, bool]] = []
    threads = [threading.Thread(target=lambda x=x: got.append(cache.get(x))) for x in loads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return got


def test_loads_from_a_new_engine_wait_for_the_one_handshake_started_ahead(
    links: tuple[LinkCache, LinkCounter], prefills: dict[str, Prefill]
) -> None:
    cache, counter = links
    a = prefills["prefill-a"]
    a.gate.clear()
    cache.connect_ahead(a.load())  # returns at once: the handshake is held at the server
    assert a.arrived.wait(WAIT_S), "connect_ahead did not start the handshake"
    threading.Timer(0.1, a.gate.set).start()  # let the handshake through while loads wait
    got = _get_in_threads(cache, [a.load(f"r{i}") for i in range(3)])
    assert len(got) == 3
    assert len({id(p) for p, _ in got}) == 1  # one link for every load
    assert a.handshakes == 1 and counter.connected == ["prefill-a"]
    assert cache.get(a.load())[1] is True  # cached from now on
    cache.connect_ahead(a.load())
    assert a.handshakes == 1  # a linked engine is not handshaken again


def test_a_held_handshake_does_not_hold_up_loads_from_another_engine(
    links: tuple[LinkCache, LinkCounter], prefills: dict[str, Prefill]
) -> None:
    cache, _ = links
    a, b = prefills["prefill-a"], prefills["prefill-b"]
    a.gate.clear()
    stuck: list[tuple[Peer, bool]] = []
    waiter = threading.Thread(target=lambda: stuck.append(cache.get(a.load())))
    waiter.start()
    assert a.arrived.wait(WAIT_S)
    peer_b, cached = cache.get(b.load())  # while a's handshake is still held
    assert not cached and b.handshakes == 1
    assert waiter.is_alive() and not stuck, "b's load waited for a's handshake"
    a.gate.set()
    waiter.join(WAIT_S)
    assert len(stuck) == 1 and stuck[0][0] is not peer_b


def test_a_refused_handshake_fails_its_loads_and_the_next_load_tries_again(
    links: tuple[LinkCache, LinkCounter], prefills: dict[str, Prefill]
) -> None:
    cache, counter = links
    a = prefills["prefill-a"]
    a.refuse = 1
    cache.connect_ahead(a.load())
    with pytest.raises(IncompatibleLayoutError, match="refused by the test"):
        cache.get(a.load())
    assert counter.connected == []
    _, cached = cache.get(a.load())
    assert not cached and a.handshakes == 2 and counter.connected == ["prefill-a"]


def test_a_load_waits_for_a_handshake_no_longer_than_its_deadline(
    prefills: dict[str, Prefill],
) -> None:
    a = prefills["prefill-a"]
    a.gate.clear()
    counter = LinkCounter()
    cache = LinkCache(
        counter,  # type: ignore[arg-type]
        lambda address, rank: ControlClient(address, timeout_s=5.0),
        lambda layout: peer(layout, "decode-0", Role.DECODE),
        LocalMemory(1, LAYOUT, "cpu"),
        {},
        None,  # type: ignore[arg-type]
        handshake_wait_s=0.2,
    )
    try:
        with pytest.raises(TransferTimeoutError, match="no handshake with prefill-a"):
            cache.get(a.load())
    finally:
        a.gate.set()
        cache.close()  # waits for the held handshake, then drops its link
    assert counter.disconnected == len(counter.connected)


class StuckLoad(LinkCounter):
    """A transport whose loading of the peer's agent metadata hangs until ``gate`` opens,
    naming its steps as NixlTransport.connect does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def connect(self, engine: str, metadata: bytes, layout: KVLayout, target: object) -> object:
        link_step(f"NIXL add_remote_agent (loading {engine}'s agent metadata)")
        self.gate.wait(WAIT_S)
        link_step("NIXL descriptor list prep")
        return super().connect(engine, metadata, layout, target)


@pytest.mark.parametrize("stuck_in", ["handshake", "add_remote_agent"])
def test_a_load_that_gives_up_on_a_link_names_the_step_that_did_not_finish(
    prefills: dict[str, Prefill], stuck_in: str
) -> None:
    a = prefills["prefill-a"]
    transport = StuckLoad()
    if stuck_in == "handshake":
        a.gate.clear()
    else:
        a.gate.set()
    cache = LinkCache(
        transport,  # type: ignore[arg-type]
        lambda address, rank: ControlClient(address, timeout_s=5.0),
        lambda layout: peer(layout, "decode-0", Role.DECODE),
        LocalMemory(1, LAYOUT, "cpu"),
        {},
        None,  # type: ignore[arg-type]
        handshake_wait_s=0.5,
    )
    try:
        with pytest.raises(TransferTimeoutError) as info:
            cache.get(a.load())
    finally:
        a.gate.set()
        transport.gate.set()
        cache.close()
    message = str(info.value)
    assert message.startswith("no handshake with prefill-a (TP rank 0) at 127.0.0.1:"), message
    if stuck_in == "handshake":
        assert re.search(
            r"in 0\.5s: the handshake RPC \(dial included\) not finished after", message
        )
        assert "add_remote_agent" not in message
    else:
        assert re.search(
            r"in 0\.5s: the handshake RPC \(dial included\) finished in \d+\.\d\ds, "
            r"NIXL add_remote_agent \(loading prefill-a's agent metadata\) "
            r"not finished after 0\.\ds$",
            message,
        ), message


def test_a_new_link_is_warmed_by_a_seal_read_before_any_load_gets_it() -> None:
    """The first READ over a new NIXL link pays UCX's endpoint wireup (measured 25-350 ms);
    the link's own warm-up READ of a seal slot pays it inside the handshake instead."""
    a = Prefill("prefill-a", seals=True)
    counter = LinkCounter()
    seals = WarmCounter(counter)
    cache = _cache(counter, seals)
    try:
        got, cached = cache.get(a.load())
        assert not cached and got.seal_link is not None
        # one warm-up, on the seal link, once both links were made, before get() returned
        assert seals.warmed == [(got.seal_link, 2)]
        assert got.warm_ms is not None
        cache.get(a.load("r2"))
        assert len(seals.warmed) == 1  # a cached link is not warmed again
    finally:
        cache.close()
        a.server.close()
    assert counter.disconnected == len(counter.connected) == 2


def test_a_failed_warm_up_fails_the_handshake_and_leaves_no_link() -> None:
    a = Prefill("prefill-a", seals=True)
    counter = LinkCounter()
    cache = _cache(counter, WarmCounter(counter, fail=1))
    try:
        with pytest.raises(TransferTimeoutError, match="warm-up READ refused"):
            cache.get(a.load())
        assert counter.disconnected == len(counter.connected) == 2  # both links undone
        _, cached = cache.get(a.load())  # the next load links again
        assert not cached and a.handshakes == 2
    finally:
        cache.close()
        a.server.close()


def test_an_allowed_peer_is_linked_at_start_so_its_first_load_finds_the_link(
    links: tuple[LinkCache, LinkCounter], prefills: dict[str, Prefill]
) -> None:
    cache, counter = links
    a = prefills["prefill-a"]
    cache.connect_address(a.server.address, lambda tp_size: [0])
    deadline = time.monotonic() + WAIT_S
    while not counter.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counter.connected == ["prefill-a"]
    peer_a, cached = cache.get(a.load())
    assert cached, "the first load made its own link"
    assert peer_a.address == a.server.address


def test_an_allowed_peer_that_refuses_at_first_is_tried_again_and_linked_before_its_loads(
    links: tuple[LinkCache, LinkCounter], prefills: dict[str, Prefill]
) -> None:
    cache, counter = links
    a = prefills["prefill-a"]
    a.refuse = 1  # e.g. still starting: the first early handshake fails
    cache.connect_address(a.server.address, lambda tp_size: [0])
    deadline = time.monotonic() + WAIT_S
    while not counter.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counter.connected == ["prefill-a"]
    _, cached = cache.get(a.load())
    assert cached and a.handshakes == 3  # refused, then one to learn the engine, one to link


def test_an_allowed_peer_that_never_answers_is_named_in_one_warning_when_the_tries_end(
    links: tuple[LinkCache, LinkCounter],
    prefills: dict[str, Prefill],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvbridge.connector.load import links as links_module

    cache, counter = links
    a = prefills["prefill-a"]
    a.refuse = 10**6  # a peer that is up but refuses every handshake
    monkeypatch.setattr(links_module, "EARLY_LINK_TRIES", 2)
    with caplog.at_level(logging.INFO, logger=links_module.__name__):
        cache.connect_address(a.server.address, lambda tp_size: [0])
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not any(
            r.levelno == logging.WARNING for r in caplog.records
        ):
            time.sleep(0.01)
    assert a.handshakes == 2
    levels = [r.levelno for r in caplog.records if a.server.address in r.getMessage()]
    assert levels == [logging.INFO, logging.WARNING], caplog.text
    assert counter.connected == []

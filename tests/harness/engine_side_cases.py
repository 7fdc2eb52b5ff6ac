"""One engine side for both engines: built in one order, its config built once, torn down
whole (real NIXL agent, real gRPC on loopback).

These cases load NIXL into the process that runs them, so tests/test_engine_side.py runs them
in a child pytest: the suite's own process loads no NIXL (loaded there after hundreds of
other tests, NIXL's import aborted the whole run once).
"""

from __future__ import annotations

import socket
import threading

import pytest

from kvbridge.connector import ConnectorConfig, ServerOptions
from kvbridge.connector.control import ControlClient
from kvbridge.connector.engine_side import EngineSide
from kvbridge.proto import ConfigError, preset_layout
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.pool_owner import PoolBlockOwner


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(("kvb-", "kvbridge-"))}


def test_the_config_carries_the_bound_control_address_and_the_callers_is_untouched() -> None:
    config = ConnectorConfig("side-a", role="prefill")
    side = EngineSide(config, control=ServerOptions())
    try:
        assert side.control is not None and side.control.port > 0
        assert side.config.control_address == side.control.address
        assert config.control_address == ""  # built once, not rewritten
    finally:
        side.close()
    advertised = ConnectorConfig("side-b", role="prefill", control_address="10.0.0.1:7600")
    side = EngineSide(advertised, control=ServerOptions())
    try:
        assert side.config.control_address == "10.0.0.1:7600"  # the operator's address wins
    finally:
        side.close()


def test_serve_starts_leases_and_the_control_server_over_the_registered_memory() -> None:
    layout = preset_layout("tiny", num_blocks=4)
    caches = layout.allocate("cpu")
    side = EngineSide(ConnectorConfig("side-c", role="prefill"), control=ServerOptions())
    try:
        side.loader.register_kv_caches(caches, layout.bind(caches))
        owner = PoolBlockOwner({g.name: BlockPool(g.num_blocks) for g in layout.groups})
        leases = side.serve(owner)
        assert side.leases is leases and leases.seal is side.loader.seal
        with ControlClient(side.control.address) as client:  # type: ignore[union-attr]
            health = client.health()
            assert health.engine_id == "side-c" and health.num_leases == 0
    finally:
        side.close()


def test_a_taken_control_port_fails_construction_and_leaves_no_thread() -> None:
    before = _threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="cannot listen"):
            EngineSide(
                ConnectorConfig("side-d", role="prefill"),
                control=ServerOptions(port=taken.getsockname()[1]),
            )
    assert _threads() <= before


def test_a_consumer_side_serves_no_control_port() -> None:
    side = EngineSide(ConnectorConfig("side-e", role="decode"))
    try:
        assert side.control is None and side.config.control_address == ""
    finally:
        side.close()

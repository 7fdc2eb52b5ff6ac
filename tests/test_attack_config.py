"""Attacks on the knobs (ConnectorConfig, vLLM's kv_connector_extra_config): every odd value
is a ConfigError naming the knob at start-up, never a NaN lease that never expires, a bare
ValueError, or a token of the wrong type that fails later inside gRPC."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvbridge.connector import ConnectorConfig
from kvbridge.connector.control import LeaseTable
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.proto import BlockId, ConfigError, preset_layout
from tests.harness.control import FakeOwner


def vllm(**extra: Any) -> VllmConnectorConfig:
    return VllmConnectorConfig.from_vllm("kv_producer", "eng", {"control_port": 7600, **extra}, "m")


@pytest.mark.parametrize("knob", ["lease_ttl_s", "max_lease_ttl_s", "load_timeout_s"])
@pytest.mark.parametrize("bad", ["nan", math.nan, math.inf, "inf", "abc", None, [1], True, 0, -1])
def test_a_time_knob_must_be_a_finite_positive_number(knob: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=knob):
        vllm(**{knob: bad})


@pytest.mark.parametrize("knob", ["lease_ttl_s", "max_lease_ttl_s", "load_timeout_s"])
def test_connector_config_refuses_nan_and_infinite_times(knob: str) -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(ConfigError, match=knob):
            ConnectorConfig(engine_id="e", **{knob: bad})


@pytest.mark.parametrize("ttl", [math.nan, math.inf, -math.inf, 0.0])
def test_a_ttl_that_never_expires_is_refused_by_the_lease_table(ttl: float) -> None:
    # NaN passes `ttl_s <= 0`: its deadline would sit at the heap's root, never expire, and
    # keep every later lease from expiring too; infinity would never expire either
    now = [0.0]
    table = LeaseTable(FakeOwner(preset_layout("tiny", num_blocks=8)), clock=lambda: now[0])
    with pytest.raises(ConfigError, match="ttl_s"):
        table.create({"self": [BlockId(0)]}, ttl_s=ttl)
    lease = table.create({"self": [BlockId(1)]}, ttl_s=1.0)
    with pytest.raises(ConfigError, match="ttl_s"):
        table.heartbeat([lease.lease_id], ttl_s=ttl)
    now[0] = 2.0
    assert table.expire() == 1 and len(table) == 0


@pytest.mark.parametrize("bad", [123, "", "a\nb", "tök", ["t"]])
def test_a_token_that_cannot_travel_as_metadata_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="token"):
        vllm(token=bad)


@pytest.mark.parametrize("knob", ["control_host", "advertise_host"])
@pytest.mark.parametrize("bad", [["x"], 1, ""])
def test_hosts_must_be_strings(knob: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=knob):
        vllm(**{knob: bad})


def test_good_values_still_pass() -> None:
    cfg = vllm(lease_ttl_s="20", load_timeout_s=5, token="secret", advertise_host="10.0.0.1")
    assert (cfg.connector.lease_ttl_s, cfg.connector.load_timeout_s) == (20.0, 5.0)
    assert cfg.connector.control_address == "10.0.0.1:7600"


@pytest.mark.parametrize("server", ["control", "offload"])
def test_a_server_never_takes_an_infinite_lease_cap(server: str) -> None:
    # with max_ttl_s = inf (`kvbridge serve --max-lease-ttl inf`, `offload serve --max-ttl
    # inf`) an authenticated caller pins blocks for as long as its ttl_ms field can say
    from kvbridge.connector.control import ControlServerConfig
    from kvbridge.worker.offload import OffloadConfig

    config = ControlServerConfig if server == "control" else OffloadConfig
    for bad in (math.inf, math.nan):
        with pytest.raises(ConfigError, match="max_ttl_s"):
            config(max_ttl_s=bad)
    with pytest.raises(ConfigError, match="reap_interval_s"):
        config(reap_interval_s=math.nan)
    assert config(max_ttl_s=60.0).max_ttl_s == 60.0


def test_a_plaintext_token_beyond_loopback_needs_the_operators_word() -> None:
    with pytest.raises(ConfigError, match=r"insecure_plaintext_token.*accept that risk"):
        vllm(token="secret", control_host="0.0.0.0")
    cfg = vllm(token="secret", control_host="0.0.0.0", insecure_plaintext_token=True)
    assert cfg.control_host == "0.0.0.0"
    vllm(control_host="0.0.0.0")  # no token: nothing to read off the wire
    vllm(token="secret", control_host="::1")  # loopback

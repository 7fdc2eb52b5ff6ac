"""The vLLM extra config's trust keys: ``allowed_peers`` and ``max_lease_ttl_s``."""

from __future__ import annotations

import pytest

from kvbridge.connector.control.peers import peer_allowed
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.proto import ConfigError


def config(**extra: object) -> VllmConnectorConfig:
    return VllmConnectorConfig.from_vllm("kv_consumer", "decode-a", extra, model="tiny")


def test_allowed_peers_name_the_only_prefill_addresses_decode_dials() -> None:
    cc = config(allowed_peers=["10.0.0.5:50051", "Prefill.example:50051"]).connector
    assert cc.allowed_peers == ("10.0.0.5:50051", "prefill.example:50051")
    assert peer_allowed("10.0.0.5:50051", cc.allowed_peers)
    assert not peer_allowed("127.0.0.1:50051", cc.allowed_peers)


def test_without_allowed_peers_decode_dials_loopback_only() -> None:
    cc = config().connector
    assert cc.allowed_peers == ()
    assert peer_allowed("127.0.0.1:50051", cc.allowed_peers)
    assert not peer_allowed("10.0.0.5:50051", cc.allowed_peers)


@pytest.mark.parametrize("bad", ["10.0.0.5:50051", ["10.0.0.5"], [5]])
def test_allowed_peers_must_be_a_list_of_host_and_port(bad: object) -> None:
    with pytest.raises(ConfigError, match="allowed_peers"):
        config(allowed_peers=bad)


def test_max_lease_ttl_is_a_knob_and_never_below_the_lease_ttl() -> None:
    assert config(max_lease_ttl_s=60).connector.max_lease_ttl_s == 60
    assert config(lease_ttl_s=900).connector.max_lease_ttl_s == 900
    with pytest.raises(ConfigError, match="max_lease_ttl_s"):
        config(lease_ttl_s=30, max_lease_ttl_s=10)

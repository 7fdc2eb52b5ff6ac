"""Which control addresses decode may dial: the allowlist, checked before any channel exists."""

from __future__ import annotations

import pytest

from kvbridge.connector import ConnectorConfig
from kvbridge.connector.addresses import normalize_address
from kvbridge.connector.control.peers import dial_control, peer_allowed
from kvbridge.proto import ConfigError, PeerError
from tests.harness.grpc_fakes import RecordingServer


def test_without_named_peers_only_loopback_addresses_may_be_dialed() -> None:
    assert peer_allowed("127.0.0.1:5000", ())
    assert peer_allowed("[::1]:5000", ())
    assert peer_allowed("LOCALHOST:5000", ())
    assert not peer_allowed("192.0.2.7:5000", ())
    assert not peer_allowed("127.0.0.1:5000", ("127.0.0.1:5001",))
    assert peer_allowed("127.0.0.1:5001", ("127.0.0.1:5001",))
    assert not peer_allowed("not an address", ())


def test_a_disallowed_address_is_refused_before_any_channel_exists() -> None:
    with RecordingServer() as recorder:
        config = ConnectorConfig("decode-x", token="t", allowed_peers=("127.0.0.1:1",))
        with pytest.raises(PeerError, match="--allow-peer"):
            dial_control(recorder.address, config)
        assert recorder.calls == []


def test_allowed_peers_must_be_host_and_port() -> None:
    with pytest.raises(ConfigError, match="allowed_peers"):
        ConnectorConfig("decode-x", allowed_peers=("just-a-host",))


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("LocalHost:50051", "localhost:50051"),
        ("[0:0:0:0:0:0:0:1]:7", "[::1]:7"),
        ("10.0.0.1:0050", "10.0.0.1:50"),
    ],
)
def test_addresses_are_compared_in_one_spelling(given: str, normal: str) -> None:
    assert normalize_address(given) == normal


@pytest.mark.parametrize("bad", ["", "host", "host:", ":80", "host:99999", "a/b:80", "x" * 300])
def test_malformed_addresses_are_never_allowed(bad: str) -> None:
    with pytest.raises(ValueError):
        normalize_address(bad)
    assert not peer_allowed(bad, ())

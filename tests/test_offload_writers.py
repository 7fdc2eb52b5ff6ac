"""The daemon's writer bookkeeping and its settings, in process: sessions, notifications, flags."""

from __future__ import annotations

import argparse

import pytest

from kvbridge.connector import ServerOptions
from kvbridge.connector.offload.wire import store_notification
from kvbridge.proto import ConfigError, ControlPlaneError, WireError, preset_layout
from kvbridge.worker.engine import EngineConfig
from kvbridge.worker.offload import OffloadConfig
from kvbridge.worker.offload.cmd import add_parser, daemon_layout
from kvbridge.worker.offload.writers import Sessions, check_agent_name, route_notifications


def test_a_session_names_its_agent_and_the_least_recently_used_goes_first() -> None:
    sessions = Sessions(max_sessions=2)
    a, b = sessions.open("agent-a"), sessions.open("agent-b")
    assert len({a, b}) == 2 and len(a) == 32
    assert sessions.agent(a) == "agent-a"  # a is now the most recently used
    c = sessions.open("agent-c")
    assert len(sessions) == 2
    assert sessions.agent(a) == "agent-a" and sessions.agent(c) == "agent-c"
    with pytest.raises(ControlPlaneError, match="handshake again") as info:
        sessions.agent(b)
    assert info.value.code == "FAILED_PRECONDITION"
    with pytest.raises(ControlPlaneError):
        sessions.agent("")


def test_only_a_stores_own_writer_and_well_formed_notifications_mark_it() -> None:
    marked: list[tuple[str, str]] = []
    pending = {"s" * 32: "agent-a"}

    def mark(store_id: str, agent: str) -> bool:
        if pending.get(store_id) != agent:
            return False
        marked.append((store_id, agent))
        return True

    n = route_notifications(
        {
            "agent-b": [store_notification("s" * 32)],  # not b's store
            "agent-a": [b"release request 7", store_notification("t" * 32), b"\xff" * 40],
        },
        mark,
    )
    assert (n, marked) == (0, [])
    assert route_notifications({"agent-a": [store_notification("s" * 32)]}, mark) == 1
    assert marked == [("s" * 32, "agent-a")]


def test_a_worker_that_reconnects_in_a_loop_drops_only_its_own_sessions() -> None:
    sessions = Sessions(max_sessions=4, per_agent=2)
    other = sessions.open("steady")
    flapping = [sessions.open("flapping") for _ in range(10)]
    assert len(sessions) == 3
    assert sessions.agent(other) == "steady"
    assert [sessions.agent(s) for s in flapping[-2:]] == ["flapping", "flapping"]
    with pytest.raises(ControlPlaneError):
        sessions.agent(flapping[-3])


def test_a_peer_under_many_names_drops_only_its_own_sessions_and_owns_them() -> None:
    sessions = Sessions(max_sessions=6, per_agent=2, per_peer=3)
    honest = sessions.open("honest", "token:h")
    flood = [sessions.open(f"name-{i}", "token:f") for i in range(10)]
    assert len(sessions) == 4 and sessions.of_peer("token:f") == 3
    assert sessions.agent(honest, "token:h") == "honest"
    assert [sessions.agent(s, "token:f") for s in flood[-3:]] == ["name-7", "name-8", "name-9"]
    with pytest.raises(ControlPlaneError):
        sessions.agent(flood[0], "token:f")  # its own oldest went
    with pytest.raises(ControlPlaneError):
        sessions.agent(honest, "token:f")  # another peer's session id is no credential


@pytest.mark.parametrize("name", ["", "x" * 129, "tab\there", "é"])
def test_a_bad_agent_name_is_refused_naming_the_rule(name: str) -> None:
    with pytest.raises(WireError, match="NIXL agent name"):
        check_agent_name(name)


def test_model_flag_takes_the_names_kvbridge_serve_uses_and_layout_presets() -> None:
    engine = daemon_layout("share-tiny", 16, 1, 7)
    assert engine.model == EngineConfig.preset("share-tiny", seed=7).layout().model
    assert daemon_layout("llama3-8b", 16, 2, 0).model == preset_layout("llama3-8b").model
    with pytest.raises(ConfigError, match=r"'nope' is not one of tiny, small"):
        daemon_layout("nope", 16, 1, 0)
    with pytest.raises(ConfigError, match="tp_size 1"):
        daemon_layout("tiny", 16, 2, 0)


def test_serve_flags_reach_the_config_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_TOKEN", "from-env")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["offload", "serve", "--max-stores-per-writer", "3", "--max-pinned-per-writer", "5"]
    )
    assert (args.token, args.max_stores_per_writer, args.max_pinned_per_writer) == (
        "from-env",
        3,
        5,
    )


@pytest.mark.parametrize(
    ("knob", "value", "named"),
    [
        ("max_stores_per_writer", 0, "max_stores_per_writer"),
        ("max_pinned_per_writer", 0, "max_pinned_per_writer"),
        ("max_sessions", 0, "max_sessions"),
        ("max_sessions_per_peer", 0, "max_sessions_per_peer"),
        ("default_ttl_s", 1000.0, "--default-ttl"),
        ("idle_timeout_s", 0.0, "idle_timeout_s"),
        ("commit_wait_s", -1.0, "commit_wait_s"),
        ("token", "", "token"),
        ("tls_cert", b"pem", "tls_cert and tls_key"),
    ],
)
def test_a_bad_knob_is_refused_by_name(knob: str, value: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        if knob in ("token", "tls_cert"):  # where the daemon listens: its ServerOptions
            OffloadConfig(listen=ServerOptions(**{knob: value}))  # type: ignore[arg-type]
        else:
            OffloadConfig(**{knob: value})  # type: ignore[arg-type]

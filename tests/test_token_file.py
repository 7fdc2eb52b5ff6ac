"""Per-peer tokens: a ``--token-file`` lists several tokens, one a line, each its own peer.

One shared token makes every holder one peer sharing one allowance; a token
file with one token per peer gives each peer its own caps. Read by
``kvbridge serve``, ``kvbridge offload serve`` and ``kvbridge serve-control``;
checked here over real gRPC on loopback (the control server in process, and
``serve-control`` as a real process). The offload daemon's half is in
``test_offload_trust.py``.
"""

from __future__ import annotations

import pickle
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.connector import ServerOptions
from kvbridge.connector.control import ControlClient, ControlServerConfig
from kvbridge.connector.control.auth import TokenSet, accepted_tokens, token_identity
from kvbridge.proto import AuthError, ConfigError, ControlPlaneError, preset_layout
from kvbridge.worker import ChildProcess, listening_on
from kvbridge.worker.cli import build_parser
from kvbridge.worker.server_auth import read_auth, read_token_file
from tests.harness.control import Cluster, hashes, start_cluster, stop_cluster

FILE = "# per-peer tokens\n\ndecode-a-token\n  decode-b-token  \n# retired: old-token\n"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(FILE)
    return path


@pytest.mark.parametrize("command", [["serve"], ["offload", "serve"]])
def test_a_token_file_lists_several_tokens_and_the_first_is_the_one_sent(
    command: list[str], token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVBRIDGE_TOKEN", raising=False)
    got = read_auth(build_parser().parse_args([*command, "--token-file", str(token_file)]))
    assert accepted_tokens(got.token) == ("decode-a-token", "decode-b-token")
    assert str(got.token) == "decode-a-token"  # what a client built from it sends
    assert "decode" not in repr(got.token)  # a log line never shows the secrets
    # a config that crosses a process boundary keeps every token
    assert accepted_tokens(pickle.loads(pickle.dumps(got.token))) == accepted_tokens(got.token)
    # one token stays a plain string, as before
    token_file.write_text("only-one\n")
    assert read_token_file(token_file) == "only-one"
    assert accepted_tokens(read_token_file(token_file)) == ("only-one",)


@pytest.mark.parametrize("content", [b"", b"\n\n", b"# a comment only\n  \n"])
def test_a_token_file_naming_no_token_is_a_config_error_naming_the_flag(
    content: bytes, tmp_path: Path
) -> None:
    (tmp_path / "tokens").write_bytes(content)
    with pytest.raises(ConfigError, match=r"^--token-file .*tokens.* is empty") as info:
        read_token_file(tmp_path / "tokens")
    assert "\n" not in str(info.value)


def test_a_token_line_that_cannot_travel_is_refused_naming_flag_and_line(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("good\nbad\x01token\n")
    with pytest.raises(ConfigError, match=r"^--token-file .* line 2: .*printable ASCII"):
        read_token_file(tmp_path / "tokens")
    (tmp_path / "tokens").write_text("gøød\n")
    with pytest.raises(ConfigError, match=r"line 1"):
        read_token_file(tmp_path / "tokens")
    with pytest.raises(ConfigError, match="--token-file"):
        read_token_file(tmp_path / "missing")
    with pytest.raises(ConfigError):
        TokenSet([])


@pytest.fixture
def two_peers(token_file: Path) -> Iterator[Cluster]:
    config = ControlServerConfig(
        listen=ServerOptions(token=read_token_file(token_file)),
        default_ttl_s=2.0,
        max_ttl_s=5.0,
        max_leases_per_peer=2,
        max_blocks_per_peer=8,
    )
    c = start_cluster(preset_layout("tiny", num_blocks=32), config)
    yield c
    stop_cluster(c)


def client(c: Cluster, token: str | None) -> ControlClient:
    made = ControlClient(c.server.address, token=token, timeout_s=5.0)
    c.clients.append(made)
    return made


def test_two_tokens_of_one_file_are_two_peers_with_their_own_caps(two_peers: Cluster) -> None:
    two_peers.owner.fill(hashes(8))
    a, b = client(two_peers, "decode-a-token"), client(two_peers, "decode-b-token")
    held = [a.pin_hashes({"self": hashes(1)}).lease_id for _ in range(2)]
    with pytest.raises(ControlPlaneError) as info:
        a.pin_hashes({"self": hashes(1)})
    assert info.value.code == "RESOURCE_EXHAUSTED"
    held += [b.pin_hashes({"self": hashes(1)}).lease_id for _ in range(2)]  # b's own cap
    leases = two_peers.leases
    assert leases.peer_usage(token_identity("decode-a-token")) == (2, 1)
    assert leases.peer_usage(token_identity("decode-b-token")) == (2, 1)
    # b cannot extend a's lease: the tokens are different peers
    assert held[0] not in b.heartbeat([held[0]])
    assert held[0] in a.heartbeat([held[0]])
    # a node dialling with its own token file sends the first token: it is peer a
    node = client(two_peers, TokenSet(["decode-a-token", "decode-b-token"]))
    with pytest.raises(ControlPlaneError, match="exceed its caps"):
        node.pin_hashes({"self": hashes(1)})
    for stranger in ("old-token", "# per-peer tokens", None):
        with pytest.raises(AuthError):
            client(two_peers, stranger).health()
    for lease in held:
        assert lease is not None and a.release(lease)


def test_serve_control_accepts_each_token_of_its_file_and_no_other(token_file: Path) -> None:
    proc = ChildProcess(
        [sys.executable, "-m", "kvbridge.worker.serving.control_cmd", "--preset", "tiny",
         "--engine-id", "p-file", "--token-file", str(token_file)],
        name="serve-control",
        ready=listening_on,
        env={"PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    with proc:
        address = proc.wait_ready()["address"]
        for token in ("decode-a-token", "decode-b-token"):
            with ControlClient(address, token=token) as c:
                assert c.health().engine_id == "p-file"
        with ControlClient(address, token="old-token") as c, pytest.raises(AuthError):
            c.health()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0

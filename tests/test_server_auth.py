"""``kvbridge serve`` and ``kvbridge offload serve`` take the same token and TLS flags,
read them the same way and warn the same way (kvbridge.worker.server_auth)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from kvbridge.proto import ConfigError
from kvbridge.worker.cli import build_parser
from kvbridge.worker.server_auth import read_auth, warn_if_open


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [["serve"], ["offload", "serve"]])
def test_both_servers_read_a_token_file_and_tls_files(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVBRIDGE_TOKEN", raising=False)
    (tmp_path / "token").write_text("secret\n")
    (tmp_path / "cert.pem").write_bytes(b"CERT")
    (tmp_path / "key.pem").write_bytes(b"KEY")
    tls = ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]
    got = read_auth(parse(*command, "--token-file", str(tmp_path / "token"), *tls))
    assert (got.token, got.tls_cert, got.tls_key) == ("secret", b"CERT", b"KEY")
    # only the node dials peers: it trusts its own certificate by default, the daemon nothing
    assert got.tls_root_cert == (b"CERT" if command == ["serve"] else None)
    assert read_auth(parse(*command)).token is None
    monkeypatch.setenv("KVBRIDGE_TOKEN", "from-env")
    assert read_auth(parse(*command)).token == "from-env"


@pytest.mark.parametrize("command", [["serve"], ["offload", "serve"]])
def test_missing_or_half_given_files_are_config_errors_naming_the_flag(
    command: list[str], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        read_auth(parse(*command, "--tls-cert", str(tmp_path / "cert.pem")))
    missing = ["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(tmp_path / "no.pem")]
    with pytest.raises(ConfigError, match=r"--tls-cert .*no\.pem"):
        read_auth(parse(*command, *missing))
    with pytest.raises(ConfigError, match="--token-file"):
        read_auth(parse(*command, "--token-file", str(tmp_path / "none")))
    with pytest.raises(SystemExit):  # argparse: one of --token / --token-file
        parse(*command, "--token", "a", "--token-file", str(tmp_path / "token"))


def test_only_an_unguarded_non_loopback_listener_is_warned_about(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = logging.getLogger("kvbridge.test.server_auth")
    monkeypatch.delenv("KVBRIDGE_TOKEN", raising=False)
    open_auth = read_auth(parse("offload", "serve"))
    assert open_auth.token is None
    guarded = read_auth(parse("offload", "serve", "--token", "t", "--insecure-plaintext-token"))
    with caplog.at_level(logging.WARNING, logger=log.name):
        warn_if_open(log, "127.0.0.1", open_auth, "store and load blocks")
        warn_if_open(log, "::1", open_auth, "store and load blocks")
        warn_if_open(log, "10.0.0.1", guarded, "store and load blocks")
        assert caplog.records == []
        warn_if_open(log, "0.0.0.0", open_auth, "store and load blocks")
    assert [r.getMessage() for r in caplog.records] == [
        "listening on 0.0.0.0 without a token: anyone who reaches the port may store and "
        "load blocks; set --token or $KVBRIDGE_TOKEN"
    ]


def test_an_unreadable_default_root_names_the_flag_it_came_from(tmp_path: Path) -> None:
    # the node trusts its own --tls-cert by default: a read error there names --tls-cert
    args = parse("serve", "--tls-cert", str(tmp_path / "gone.pem"), "--tls-key", "k")
    with pytest.raises(ConfigError, match="--tls-cert"):
        read_auth(args)
    (tmp_path / "c.pem").write_bytes(b"C")
    (tmp_path / "k.pem").write_bytes(b"K")
    tls = ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
    with pytest.raises(ConfigError, match=r"--tls-ca .*ca\.pem"):
        read_auth(parse("serve", *tls, "--tls-ca", str(tmp_path / "ca.pem")))


PLAINTEXT = (
    r"refusing to serve a token in plaintext on 10\.0\.0\.1.*"
    r"--tls-cert/--tls-key.*--insecure-plaintext-token"
)


@pytest.mark.parametrize("command", [["serve"], ["offload", "serve"]])
def test_a_plaintext_token_beyond_loopback_needs_the_operators_word(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVBRIDGE_TOKEN", raising=False)
    log = logging.getLogger("kvbridge.test.server_auth")
    plain = read_auth(parse(*command, "--token", "t"))
    with pytest.raises(ConfigError, match=PLAINTEXT):
        warn_if_open(log, "10.0.0.1", plain, "pin blocks")
    with pytest.raises(ConfigError, match=r"plaintext on 0\.0\.0\.0"):
        warn_if_open(log, "0.0.0.0", plain, "pin blocks")
    for host in ("127.0.0.1", "::1", "localhost"):  # loopback never leaves the host
        warn_if_open(log, host, plain, "pin blocks")
    (tmp_path / "c").write_bytes(b"C")
    tls = ["--tls-cert", str(tmp_path / "c"), "--tls-key", str(tmp_path / "c")]
    warn_if_open(log, "10.0.0.1", read_auth(parse(*command, "--token", "t", *tls)), "x")
    accepted = read_auth(parse(*command, "--token", "t", "--insecure-plaintext-token"))
    warn_if_open(log, "10.0.0.1", accepted, "pin blocks")
    warn_if_open(log, "10.0.0.1", read_auth(parse(*command)), "pin blocks")  # no token


@pytest.mark.parametrize(
    "command", [["serve-control"], ["serve", "--role", "decode"], ["offload", "serve"]]
)
def test_every_server_command_refuses_a_plaintext_token_beyond_loopback(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvbridge.worker.cli import main

    code = main([*command, "--host", "0.0.0.0", "--token", "t"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--insecure-plaintext-token" in err and "--tls-cert/--tls-key" in err

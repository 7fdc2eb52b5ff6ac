"""Attacks on the shared server flags (kvbridge.worker.server_auth): a token file that
names no token must never leave a server listening without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.proto import ConfigError
from kvbridge.worker.cli import build_parser
from kvbridge.worker.server_auth import read_auth


@pytest.mark.parametrize("command", [["serve"], ["offload", "serve"]])
@pytest.mark.parametrize("content", [b"", b"\n", b"  \t\n"])
def test_an_empty_token_file_is_a_config_error_not_an_open_server(
    command: list[str], content: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # e.g. a secret mount that is not populated yet: the operator asked for a token
    monkeypatch.delenv("KVBRIDGE_TOKEN", raising=False)
    (tmp_path / "token").write_bytes(content)
    args = build_parser().parse_args([*command, "--token-file", str(tmp_path / "token")])
    with pytest.raises(ConfigError, match=r"--token-file .*token.* is empty"):
        read_auth(args)


@pytest.mark.parametrize("command", [["serve"], ["offload", "serve"]])
def test_a_token_file_that_is_not_utf8_is_a_config_error(
    command: list[str], tmp_path: Path
) -> None:
    (tmp_path / "token").write_bytes(b"\xff\xfe\x00secret")
    args = build_parser().parse_args([*command, "--token-file", str(tmp_path / "token")])
    with pytest.raises(ConfigError, match=r"--token-file .*UTF-8"):
        read_auth(args)

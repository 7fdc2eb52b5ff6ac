"""``kv_connector_extra_config``: no key is needed on one machine, the token can come from a
file, the control server speaks TLS like ``kvbridge serve``'s, and docs/VLLM.md lists exactly
the keys the config knows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvbridge.connector.vllm.config import (
    DEFAULT_CONTROL_PORT,
    KNOWN_KEYS,
    VllmConnectorConfig,
)
from kvbridge.proto import ConfigError
from tests.harness.fresh import run_python

ROOT = Path(__file__).resolve().parents[1]


def _config(role: str, **extra: object) -> VllmConnectorConfig:
    return VllmConnectorConfig.from_vllm(role, "engine-a", extra, model="tiny")


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_producer_needs_no_extra_config(role: str) -> None:
    cfg = _config(role)
    assert cfg.control_port == DEFAULT_CONTROL_PORT == 7600
    assert cfg.connector.control_address == "127.0.0.1:7600"


def test_a_consumer_serves_no_control_port() -> None:
    cfg = _config("kv_consumer")
    assert cfg.control_port == 0 and cfg.connector.control_address == ""


def test_token_file_is_read_and_stripped(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cret\n")
    cfg = _config("kv_consumer", token_file=str(tmp_path / "token"))
    assert cfg.connector.token == "s3cret"


@pytest.mark.parametrize(
    ("content", "extra", "match"),
    [
        (None, {}, r"token_file .*missing.*No such file"),
        ("\n", {}, r"token_file .* is empty"),
        ("x", {"token": "y"}, r"token or token_file, not both"),
    ],
)
def test_a_bad_token_file_is_a_config_error_naming_the_key(
    tmp_path: Path, content: str | None, extra: dict[str, object], match: str
) -> None:
    path = tmp_path / ("missing" if content is None else "token")
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        _config("kv_consumer", token_file=str(path), **extra)


def test_tls_files_are_read_and_the_roots_default_to_the_certificate(
    tls_files: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = tls_files
    cfg = _config("kv_both", tls_cert=str(cert), tls_key=str(key))
    assert cfg.tls_cert == cert.read_bytes() and cfg.tls_key == key.read_bytes()
    assert cfg.connector.tls_root_cert == cert.read_bytes()
    roots = tmp_path / "roots.pem"
    roots.write_bytes(cert.read_bytes())
    decode = _config("kv_consumer", tls_ca=str(roots))
    assert decode.connector.tls_root_cert == roots.read_bytes() and decode.tls_cert is None
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        _config("kv_both", tls_cert=str(cert))
    (tmp_path / "plain").write_text("not pem")
    with pytest.raises(ConfigError, match=r"tls_ca .* is not a PEM file"):
        _config("kv_consumer", tls_ca=str(tmp_path / "plain"))


_TLS_WORKER = """
import socket, torch
from kvbridge.connector.control import ControlClient
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.worker import VllmWorker, WorkerSettings
from kvbridge.proto import ControlPlaneError

cert, key = {cert!r}, {key!r}
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
extra = dict(tls_cert=cert, tls_key=key, token="t", control_port=port)
cfg = VllmConnectorConfig.from_vllm("kv_both", "engine-a", extra, model="tiny")
settings = WorkerSettings(
    model_name="tiny", block_size=16, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key
)
worker = VllmWorker(cfg.connector, settings)
try:
    worker.register({{"layers.0.self_attn": torch.zeros(2, 8, 16, 1, 8)}})
    address = worker.control.address
    with ControlClient(address, token="t", root_cert=open(cert, "rb").read()) as secure:
        print("tls", secure.health().engine_id)
    with ControlClient(address, token="t", timeout_s=1.0, retries=0) as plain:
        try:
            plain.health()
            print("plaintext answered")
        except ControlPlaneError as exc:
            print("plaintext", exc.code)
finally:
    worker.close()
"""


def test_the_producer_workers_control_server_speaks_tls_only(
    tls_files: tuple[Path, Path],
) -> None:
    # a fresh interpreter: a NIXL agent and a TLS gRPC server in the pytest process make a
    # later import of grpc_tools (test_control_cli) crash
    cert, key = tls_files
    out = run_python(_TLS_WORKER.format(cert=str(cert), key=str(key)), timeout_s=120)
    lines = [x for x in out.splitlines() if x.startswith(("tls ", "plaintext "))]  # not NIXL's
    assert lines == ["tls engine-a", "plaintext UNAVAILABLE"], out


def _documented_keys() -> set[str]:
    """The first column of docs/VLLM.md's ``kv_connector_extra_config`` table."""
    text = (ROOT / "docs" / "VLLM.md").read_text()
    section = text.split("### `kv_connector_extra_config`", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))


def test_docs_list_every_key_and_no_other() -> None:
    assert _documented_keys() == set(KNOWN_KEYS)


def test_the_config_docstring_lists_every_key() -> None:
    from kvbridge.connector.vllm import config

    assert config.__doc__ is not None
    table = config.__doc__.split("=====\n", 1)[1]  # the rows after the table's first rule
    documented = set(re.findall(r"^``(\w+)``\s", table, flags=re.M))
    assert documented == set(KNOWN_KEYS)

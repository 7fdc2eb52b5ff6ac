"""Bad input on the command line: a non-zero exit, one or two lines naming the flag or file and
what to do, no traceback (unless ``-v``), no library log lines before the error.

Every case runs ``kvbridge`` as a subprocess, the way a user meets it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.fresh import run_python

pytestmark = pytest.mark.timeout(120)


def kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("files")
    (tmp / "not-pem").write_text("this is not a certificate\n")
    (tmp / "empty").write_text("\n")
    (tmp / "fake-pem").write_text(
        "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n"
        "-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n"
    )
    return {
        "dir": str(tmp),
        "fake-pem": str(tmp / "fake-pem"),
        "missing": str(tmp / "missing"),
        "not-pem": str(tmp / "not-pem"),
        "empty": str(tmp / "empty"),
    }


# (command line, words the error must contain); "{port}" is a busy port, "{x}" a file of `files`
CASES: list[tuple[list[str], list[str]]] = [
    (["serve-control", "--port", "{port}"], ["--port {port}", "already in use"]),
    (["offload", "serve", "--port", "{port}"], ["--port {port}", "already in use"]),
    (["serve", "--control-port", "{port}"], ["--control-port {port}", "already in use"]),
    (["serve", "--port", "{port}"], ["--port {port}", "already in use"]),
    (["serve", "--metrics-port", "{port}"], ["--metrics-port {port}", "already in use"]),
    (["serve", "--port", "70000"], ["--port", "70000"]),
    (["serve-control", "--token-file", "{missing}"], ["--token-file", "No such file"]),
    (["offload", "serve", "--token-file", "{empty}"], ["--token-file", "empty"]),
    (
        ["serve-control", "--tls-cert", "{not-pem}", "--tls-key", "{not-pem}"],
        ["--tls-cert", "not a PEM certificate"],
    ),
    (
        ["offload", "serve", "--tls-cert", "{not-pem}", "--tls-key", "{not-pem}"],
        ["--tls-cert", "not a PEM certificate"],
    ),
    (["serve", "--tls-cert", "{fake-pem}"], ["--tls-cert and --tls-key go together"]),
    (
        ["serve-control", "--tls-cert", "{fake-pem}", "--tls-key", "{fake-pem}"],
        ["--tls-cert", "--tls-key", "does not load"],
    ),
    (["serve", "--tls-ca", "{fake-pem}"], ["--tls-ca", "no usable PEM"]),
    (["serve", "--tls-ca", "{missing}"], ["--tls-ca", "No such file"]),
    (["offload", "serve", "--capacity", "1000TiB", "--model", "tiny"], ["--capacity", "memory"]),
    (["offload", "serve", "--capacity", "-5GiB"], ["--capacity", "negative"]),
    (["offload", "serve", "--capacity=-5GiB"], ["--capacity", "negative"]),
    (["offload", "serve", "--capacity", "lots"], ["--capacity", "not a size"]),
    (["offload", "serve", "--model", "gpt-9"], ["--model", "gpt-9"]),
    (["demo", "--requests", "0"], ["--requests", "at least 1"]),
    (["demo", "--requests", "-3"], ["--requests", "at least 1"]),
    (["demo", "--block-size", "0"], ["--block-size", "at least 1"]),
    (["serve", "--model", "llama3-8b"], ["llama3-8b", "reference engine runs tiny"]),
    (["serve", "--model", "gpt-9"], ["gpt-9", "tiny"]),
    (["serve", "--share-last", "3"], ["--share-last 3"]),
    (["serve", "--share-every", "1"], ["--share-every 1"]),
    (["serve", "--host", "0.0.0.0", "--role", "prefill"], ["--advertise"]),
    (["serve-control", "--host", "nohost.invalid"], ["--host", "nohost.invalid"]),
    (["layout", "--model", "gpt-9"], ["--model", "gpt-9"]),
    (["serve", "--offload", "nodaemon"], ["--offload", "HOST:PORT"]),
    (["serve", "--advertise", "nohost"], ["--advertise", "HOST:PORT"]),
    (["serve", "--allow-peer", "nohost"], ["nohost", "HOST:PORT"]),
    (["serve", "--lease-ttl", "-1"], ["--lease-ttl"]),
    (["bench", "control", "--model", "gpt-9"], ["--model", "gpt-9"]),
    (["bench", "load", "--model", "gpt-9"], ["--model", "gpt-9"]),
    (["bench", "transfer", "--models", "gpt-9"], ["gpt-9", "llama3-8b"]),
    # counts, sizes and durations: zero or negative is refused by the flag's own check
    (
        ["offload", "serve", "--max-stores-per-writer", "0"],
        ["--max-stores-per-writer", "at least 1"],
    ),
    (
        ["offload", "serve", "--max-pinned-per-writer", "-1"],
        ["--max-pinned-per-writer", "at least 1"],
    ),
    (["offload", "serve", "--max-sessions", "0"], ["--max-sessions", "at least 1"]),
    (["offload", "serve", "--idle-timeout", "-1"], ["--idle-timeout", "more than 0"]),
    (["offload", "serve", "--expired-grace", "-1"], ["--expired-grace", "0 or more"]),
    (["offload", "serve", "--default-ttl", "0"], ["--default-ttl"]),
    (["offload", "serve", "--max-ttl", "-5"], ["--max-ttl"]),
    (["offload", "serve", "--kv-events-buffer", "0"], ["--kv-events-buffer", "at least 1"]),
    (["offload", "serve", "--disk", "{not-pem}"], ["--disk", "not a writable directory"]),
    (["offload", "serve", "--disk-capacity", "lots", "--disk", "{dir}"], ["--disk-capacity"]),
    # checked before the host pool is allocated (the disk tier's own check names no model)
    (
        [
            "offload",
            "serve",
            "--model",
            "llama3-8b",
            "--capacity",
            "64MiB",
            "--disk",
            "{dir}",
            "--disk-capacity",
            "1MiB",
        ],
        ["--disk-capacity of 1048576 bytes holds no 2097152-byte block of llama3-8b (1MiB)"],
    ),
    (["offload", "serve", "--model", "tiny", "--capacity", "1KiB"], ["--capacity"]),
    (["offload", "serve", "--order", "bogus"], ["order 'bogus'", "block-nhd"]),
    (["offload", "serve", "--metrics-port", "{port}"], ["--metrics-port {port}", "already in use"]),
    (["serve-control", "--default-ttl", "0"], ["--default-ttl", "more than 0"]),
    (["serve", "--load-timeout", "0"], ["--load-timeout", "more than 0"]),
    (["serve", "--stall-before-read", "-1"], ["--stall-before-read", "0 or more"]),
    (["demo", "--startup-timeout", "0"], ["--startup-timeout", "more than 0"]),
    (["demo", "--clips", "0"], ["--clips", "at least 1"]),
    (["soak", "--concurrency", "0"], ["--concurrency", "at least 1"]),
    (["soak", "--duration", "-1"], ["--duration", "more than 0"]),
    (["soak", "--max-tokens", "1"], ["--max-tokens", "at least 2"]),
    (["soak", "--lease-ttl", "nan"], ["--lease-ttl", "not a finite number"]),
    (["bench", "hash", "--repeats", "0"], ["--repeats", "at least 1"]),
    (["bench", "hash", "--tokens", "0"], ["--tokens", "at least 1"]),
    (["bench", "kernels", "--repeats", "0"], ["--repeats", "at least 1"]),
    (["bench", "transfer", "--mib", "0"], ["--mib", "at least 1"]),
    (["bench", "transfer", "--target-progress-us", "-1"], ["--target-progress-us"]),
    (["bench", "offload", "--mib", "-1"], ["--mib", "at least 1"]),
    (["bench", "control", "--iterations", "0"], ["--iterations", "at least 1"]),
    (["bench", "load", "--requests", "0"], ["--requests", "at least 1"]),
    (["bench", "prefill-skip", "--layers", "-2"], ["--layers", "at least 1"]),
    (["bench", "vllm", "--rounds", "0"], ["--rounds", "at least 1"]),
    (["bench", "vllm", "--port", "70000"], ["--port", "70000"]),
    # a newcomer's mistakes: ports, addresses, tokens, model names, TP sizes, devices
    (["bench", "vllm", "--port", "0"], ["--port", "'0'", "1024 to 65535"]),
    (["bench", "vllm", "--port", "65530"], ["--port 65530", "--port 65499 or lower"]),
    (["layout", "--tp-size", "3"], ["--tp-size 3", "divides 8: 1, 2, 4, 8"]),
    (["serve-control", "--tp-rank", "2", "--tp-size", "2"], ["--tp-rank 2", "--tp-size 2"]),
    (["offload", "serve", "--model", "llama3-8b", "--tp-size", "3"], ["--tp-size 3"]),
    (["demo", "--model", "tny"], ["--model 'tny'", "tiny, small"]),
    (["soak", "--model", "llama3-8b"], ["--model 'llama3-8b'", "tiny, small"]),
    (["soak", "--nodes", "2,0"], ["--nodes 2,0", "at least 1"]),
    (["serve", "--token", ""], ["--token is empty", "leave it out"]),
    (["serve-control", "--token", " "], ["--token is empty"]),
    (["serve-control", "--token", "abc "], ["--token", "spaces"]),
    (["offload", "serve", "--token", "t\u00f6ken"], ["--token", "printable ASCII"]),
    (["serve", "--token-file", "{dir}"], ["--token-file", "Is a directory"]),
    (["serve", "--role", "prefill", "--advertise", "127.0.0.1:99999"], ["--advertise", "65535"]),
    (["serve", "--offload", "127.0.0.1:99999"], ["--offload '127.0.0.1:99999'", "HOST:PORT"]),
    (["serve", "--offload", ":5000"], ["--offload ':5000'", "HOST:PORT"]),
    (["serve", "--allow-peer", "127.0.0.1:0"], ["127.0.0.1:0", "port 1 to 65535"]),
    (["serve", "--device", "cuda:99"], ["--device cuda:99", "--device cpu"]),
    (["demo", "--device", "gpu"], ["--device 'gpu'", "cpu, cuda or cuda:N"]),
    (["demo", "--offload-disk", "{dir}"], ["--offload-disk needs --offload"]),
    (["demo", "--offload", "--offload-capacity", "lots"], ["--offload-capacity 'lots'"]),
    (["demo", "--offload", "--offload-restart"], ["--offload-restart needs --offload-disk"]),
    (
        ["offload", "serve", "--disk", "{dir}", "--disk-capacity", "-1GiB"],
        ["--disk-capacity '-1GiB' is negative"],
    ),
    (["offload"], ["kvbridge offload:", "required"]),
    (["offload", "serve", "--bogus"], ["kvbridge offload serve:", "--bogus"]),
    (["bench", "vllm", "--bogus"], ["kvbridge bench vllm:", "--bogus"]),
]


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_naming_the_flag(
    argv: list[str], words: list[str], busy_port: int, files: dict[str, str]
) -> None:
    def fill(text: str) -> str:
        text = text.replace("{port}", str(busy_port))
        for key, path in files.items():
            text = text.replace("{" + key + "}", path)
        return text

    out = kvbridge(*map(fill, argv))
    assert out.returncode != 0, out
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    assert "NIXL INFO" not in text and "Failed to bind" not in text, text
    lines = out.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 2, lines
    assert lines[0].startswith("kvbridge"), lines
    for word in map(fill, words):
        assert word in out.stderr, (word, out.stderr)
    assert "EngineConfig" not in out.stderr, out.stderr


def test_v_adds_the_traceback() -> None:
    out = kvbridge("-v", "serve", "--model", "llama3-8b")
    assert out.returncode == 2
    assert "Traceback" in out.stderr and "reference engine runs tiny" in out.stderr


def test_version_flag() -> None:
    out = kvbridge("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvbridge "), out
    assert "protocol" in out.stdout


def test_every_model_name_works_in_layout_and_the_old_flag_is_an_alias() -> None:
    from kvbridge.proto import PRESETS
    from kvbridge.worker.engine import ENGINE_PRESETS

    assert set(ENGINE_PRESETS) <= set(PRESETS)  # one set of names
    for name in ("share-tiny", "encdec-tiny", "kv-share-every2"):
        out = kvbridge("layout", "--model", name, "--order", "block-nhd")
        assert out.returncode == 0 and name in out.stdout, out
    out = kvbridge("layout", "--preset", "tiny", "--order", "block-nhd")
    assert out.returncode == 0 and "tiny" in out.stdout, out


def test_help_texts_carry_no_rst_markup() -> None:
    for argv in (["demo"], ["soak"], ["bench", "prefill-skip"], ["offload", "serve"]):
        out = kvbridge(*argv, "--help")
        assert out.returncode == 0, out
        assert "``" not in out.stdout and ":class:" not in out.stdout, out.stdout
        assert "`" not in out.stdout, out.stdout


def test_nixl_logs_nothing_below_warning_by_default_and_info_with_v() -> None:
    code = (
        "import sys; from kvbridge.worker.cli_checks import quiet_libraries;"
        "quiet_libraries(int(sys.argv[1]));"
        "from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport;"
        "NixlTransport(NixlConfig('quiet-check')).close()"
    )
    # other tests in this process may have set the levels: the user's choice wins, so drop them
    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "GRPC_VERBOSITY")}
    quiet = subprocess.run(
        [sys.executable, "-c", code, "0"], capture_output=True, text=True, timeout=60, env=env
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "INFO" not in quiet.stdout + quiet.stderr
    loud = subprocess.run(
        [sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=60, env=env
    )
    assert "NIXL INFO" in loud.stdout + loud.stderr


def test_negative_values_are_joined_only_after_long_options() -> None:
    from kvbridge.worker.cli_checks import merge_negative_values

    assert merge_negative_values(["--capacity", "-5GiB"]) == ["--capacity=-5GiB"]
    assert merge_negative_values(["--seed", "-3"]) == ["--seed", "-3"]  # argparse takes it
    assert merge_negative_values(["-v", "-5GiB"]) == ["-v", "-5GiB"]
    assert merge_negative_values(["--x=1", "-5GiB"]) == ["--x=1", "-5GiB"]


def test_the_cli_imports_nothing_heavy_for_help() -> None:
    out = run_python(
        "import sys; from kvbridge.worker.cli import build_parser; build_parser();"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'nixl_cu12', 'grpc')))"
    )
    assert out.strip() == "[]", out


def test_files_are_read_relative_to_the_cwd(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.cli", "serve-control", "--token-file", "token"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=90,
    )
    assert out.returncode == 2 and "--token-file 'token' is empty" in out.stderr, out


def test_an_empty_token_in_the_environment_is_refused(tmp_path: Path) -> None:
    env = {**os.environ, "KVBRIDGE_TOKEN": ""}
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.worker.cli", "serve-control"],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert out.returncode == 2, out
    assert "$KVBRIDGE_TOKEN is empty" in out.stderr and "Traceback" not in out.stderr, out


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o600, False)])
def test_a_token_file_other_users_can_read_is_warned_about(
    tmp_path: Path, files: dict[str, str], mode: int, warned: bool
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(mode)
    # the token file is read, then the lone --tls-cert stops the command before any server
    out = kvbridge("serve-control", "--token-file", str(token), "--tls-cert", files["fake-pem"])
    assert out.returncode == 2 and "--tls-cert and --tls-key go together" in out.stderr, out
    assert ("chmod 600" in out.stderr) is warned, out.stderr
    if warned:
        assert f"(mode {mode:04o})" in out.stderr and "s3cret" not in out.stderr, out.stderr


def test_every_option_of_the_serving_commands_says_what_it_does() -> None:
    """``--help`` of the commands a newcomer starts with explains every option (benchmarks
    other than ``bench vllm`` aside: their sweep flags are for whoever tunes them)."""
    import argparse

    from kvbridge.worker.cli import build_parser

    def bare(parser: argparse.ArgumentParser, name: str) -> Iterator[str]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    if name != "kvbridge bench" or sub == "vllm":
                        yield from bare(child, f"{name} {sub}")
            elif action.option_strings and not action.help:
                yield f"{name} {action.option_strings[0]}"

    assert list(bare(build_parser(), "kvbridge")) == []


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """``kvbridge layout | head``: stdout's reader closed before the command wrote; it ends
    with the status of a process SIGPIPE ended (141), no error line, no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvbridge.worker.cli", "layout"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=90,
        )
    finally:
        os.close(write_end)
    assert (out.returncode, out.stderr) == (141, ""), out

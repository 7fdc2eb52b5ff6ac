"""``kvbridge --help`` and building the parser load no torch, NIXL or gRPC."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "nixl", "nixl_cu12", "nixl_cu13", "grpc", "cupy")

_REPORT = f"import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"


def loaded_after(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\n{_REPORT}"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_building_the_cli_parser_loads_no_heavy_module() -> None:
    assert loaded_after("from kvbridge.worker.cli import build_parser; build_parser()") == "[]"


@pytest.mark.parametrize(
    "argv", [["--help"], ["bench", "--help"], ["serve", "--help"], ["offload", "serve", "--help"]]
)
def test_help_loads_no_heavy_module(argv: list[str]) -> None:
    code = (
        "from kvbridge.worker.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
    )
    assert loaded_after(code) == "[]"


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--model", "llama3-8b"],
        ["demo", "--offload-disk", "/tmp/x"],
        ["soak", "--model", "llama3-8b"],
        ["serve", "--model", "llama3-8b"],
        ["serve", "--share-last", "9"],
        ["offload", "serve", "--model", "no-such-model"],
        ["offload", "serve", "--model", "tiny", "--tp-size", "2"],
    ],
)
def test_a_flag_error_is_reported_before_any_heavy_module_loads(argv: list[str]) -> None:
    """The commands check their flags (the model name among them) before they import torch,
    NIXL or gRPC, which take seconds: the error comes first."""
    code = (
        "from kvbridge.worker.cli import main\n"
        "try:\n"
        f"    code = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "assert code == 2, code\n"
    )
    assert loaded_after(code) == "[]"

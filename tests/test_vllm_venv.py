"""``$KVBRIDGE_VLLM_VENV``: the vLLM tests and benchmark run in a vLLM environment of one's own.

Each case reads :mod:`kvbridge.worker.vllm.venv` in a fresh interpreter with the variable
set (the paths are fixed when the module loads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

_REPORT = """
import json, sys
from kvbridge.worker.vllm.venv import PYTHON, VenvError, ensure_venv
error = ""
if sys.argv[1] == "check":
    try:
        ensure_venv()
    except VenvError as exc:
        error = str(exc)
print(json.dumps({"python": str(PYTHON), "error": error}))
"""


def venv_module(venv: str | None, check: bool = True) -> dict[str, str]:
    """PYTHON, and with ``check`` what ensure_venv() refused (empty: it took the venv)."""
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_VLLM_VENV"}
    if venv is not None:
        env["KVBRIDGE_VLLM_VENV"] = venv
    out = subprocess.run(
        [sys.executable, "-c", _REPORT, "check" if check else "-"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def test_a_venv_without_vllm_is_refused_by_name_and_left_as_it_is(tmp_path: Path) -> None:
    venv = tmp_path / "my-vllm"
    got = venv_module(str(venv))
    assert got["python"] == str(venv / "bin" / "python")
    assert "$KVBRIDGE_VLLM_VENV" in got["error"] and str(venv) in got["error"], got
    assert "unset" in got["error"], got
    assert not venv.exists()  # nothing was built into the named place


@pytest.mark.skipif(not DEFAULT_PYTHON.exists(), reason="no .venv-vllm to stand in for one's own")
def test_a_venv_of_ones_own_is_used_where_vllm_imports(tmp_path: Path) -> None:
    """A venv elsewhere whose python is the checkout's vLLM python (a wrapper: a link would
    lose the venv): it is taken as it is, nothing built."""
    python = tmp_path / "own" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {DEFAULT_PYTHON} "$@"\n')
    python.chmod(0o755)
    got = venv_module(str(tmp_path / "own"))
    assert got == {"python": str(python), "error": ""}, got
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == ["bin"]


def test_without_the_variable_the_checkouts_venv_is_used() -> None:
    assert venv_module(None, check=False)["python"] == str(DEFAULT_PYTHON)

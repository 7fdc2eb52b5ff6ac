"""The engine side (connector/engine_side.py) with a real NIXL agent and real gRPC on loopback.

Its cases live in tests/harness/engine_side_cases.py and run here in a child pytest, because
they build a NIXL agent in the process that runs them and the suite's own process loads no
NIXL (every other NIXL agent of the suite lives in a subprocess too).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = "tests/harness/engine_side_cases.py"


@pytest.mark.slow
def test_the_engine_side_cases_pass_in_a_process_of_their_own() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", CASES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{CASES} failed:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert re.search(r"^4 passed", done.stdout, re.M), done.stdout[-2000:]

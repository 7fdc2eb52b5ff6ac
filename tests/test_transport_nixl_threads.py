"""NixlTransport shared by threads: no table is changed while another thread walks it.

The NIXL agent runs in a subprocess (``tests/harness/nixl_threads.py``), as in
test_transport_nixl, so this process loads no NIXL and a crash cannot take pytest down.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_connect_disconnect_register_and_close_from_threads_never_break_iteration() -> None:
    if not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl_cu13", "nixl")):
        pytest.skip("needs NIXL (nixl-cu12 or nixl-cu13)")
    env = dict(os.environ, UCX_MODULES="^ib")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.harness.nixl_threads", "300"],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["defects"] == [], "\n".join(result["defects"])
    assert result["held_after_close"] == {
        "_links": 0,
        "_peers": 0,
        "_registrations": 0,
        "_registered_addrs": 0,
    }
    # the hammering really happened before close
    assert result["done"].get("links", 0) >= 3, result["done"]
    assert result["done"].get("memories", 0) >= 3, result["done"]

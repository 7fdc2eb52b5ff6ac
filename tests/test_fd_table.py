"""A NIXL link never waits for the kernel to grow the process's file descriptor table.

Linux grows a process's descriptor table on the first open past its size and, when several
threads share it, waits for an RCU grace period there. On the loaded 2-core machine that wait
took 13-25 s, and it fell inside NIXL's ``add_remote_agent`` (UCX opens files while it loads a
peer): the first TP=2 load of a vLLM decode rank gave up after 25 s and recomputed. kvbridge
grows the table once when it makes the agent (``reserve_fd_table``). The agents run in a
child process (the suite's process loads no NIXL).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from kvbridge.connector.transport.nixl import FD_TABLE_SLOTS

ROOT = Path(__file__).resolve().parents[1]


def test_loading_a_peer_in_a_threaded_process_holding_256_descriptors_grows_no_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.harness.fd_table"],
        cwd=ROOT,
        env={**os.environ, "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert got["held"] > 256, got  # the link opened descriptors past a fresh table's 256
    assert got["before"] >= min(FD_TABLE_SLOTS, soft), got  # reserved when the agent was made
    assert got["after"] == got["before"], got  # so the link grew nothing (no RCU wait)

"""Does making a NIXL link grow this process's file descriptor table? Run by test_fd_table.

Run as ``python -m tests.harness.fd_table`` from the repository root. Like a vLLM rank, the
process has several threads (Linux then waits for an RCU grace period whenever it grows the
table: 13-25 s on the loaded 2-core machine) and holds many descriptors: after both agents
are made it opens ``/dev/null`` until it holds ``FILL`` descriptors (a fresh Python process's
table is 256 slots: full), then the reader loads the target's metadata (NIXL's
``add_remote_agent``, which opens files). Prints one JSON line: the table size before and
after the link, and how many descriptors the process held.
"""

from __future__ import annotations

import json
import os
import threading

import torch

from kvbridge.connector.transport.nixl import NixlAgent, NixlConfig, fd_table_size

FILL = 256
THREADS = 3


def main() -> None:
    stop = threading.Event()
    idle = [threading.Thread(target=stop.wait, daemon=True) for _ in range(THREADS)]
    for thread in idle:
        thread.start()
    target = NixlAgent(NixlConfig("fd-target", progress_interval_s=None))
    memory = torch.zeros(1 << 16, dtype=torch.uint8)
    target.register_memory([(memory.data_ptr(), memory.numel(), 0, "")], "cpu")
    reader = NixlAgent(NixlConfig("fd-reader", progress_interval_s=None))
    held = []
    while len(os.listdir("/proc/self/fd")) < FILL:
        held.append(os.open(os.devnull, os.O_RDONLY))
    before = fd_table_size()
    reader.add_peer("fd-target", target.metadata())
    after = fd_table_size()
    print(json.dumps({"before": before, "after": after, "held": len(os.listdir("/proc/self/fd"))}))
    reader.remove_peer("fd-target")
    for fd in held:
        os.close(fd)
    stop.set()


if __name__ == "__main__":
    main()

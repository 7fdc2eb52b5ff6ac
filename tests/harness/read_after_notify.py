"""READs that follow a notification to their owner; run as a script by test_transport_progress.

``python -m tests.harness.read_after_notify NATIVE INTERVAL N``: an owner process registers a
tiny pool with NIXL's own progress thread on or off (``NATIVE`` 1/0) and kvbridge's Python
progress loop every ``INTERVAL`` seconds (``none``: no loop); this process READs 1-3 blocks
from it N times, sending the owner a notification (a lease release's shape) before each
READ, as a decode's loads do. A READ
posted after a notification ends with an endpoint flush over TCP that completes only once
the owner's worker is progressed. Prints one JSON line: for each READ, whether it was done
when posted and the ms from post to done (None: not done within 1 s), and whether the bytes
read match the owner's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

PRESET, BLOCKS = "tiny", 16


def _owner(native: bool, interval: float | None, out: Any, stop: Any) -> None:
    os.environ.setdefault("UCX_MODULES", "^ib")
    from kvbridge.connector.transport import NixlConfig, NixlTransport
    from kvbridge.proto import preset_layout
    from tests.harness.transport_peer import block_bytes, fill

    transport = NixlTransport(
        NixlConfig("notify-owner", progress_interval_s=interval, native_progress=native)
    )
    layout = preset_layout(PRESET, num_blocks=BLOCKS, order="block-nhd")
    kv = layout.allocate("cpu")
    fill(layout, kv, seed=5)
    memory = transport.register(layout, kv)
    content = {i: block_bytes(layout, kv, "self", i) for i in range(BLOCKS)}
    out.put((transport.metadata(), memory.layout.to_bytes(), content))
    stop.wait()
    transport.close()


def main() -> int:
    native, n = sys.argv[1] == "1", int(sys.argv[3])
    interval = None if sys.argv[2] == "none" else float(sys.argv[2])
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(native, interval, out, stop), daemon=True)
    owner.start()
    metadata, layout_bytes, content = out.get(timeout=120)

    from kvbridge.connector.transport import NixlConfig, NixlTransport
    from kvbridge.proto import KVGroup, KVLayout, preset_layout
    from tests.harness.transport_peer import block_bytes

    reader = NixlTransport(NixlConfig("notify-reader", native_progress=native))
    layout = preset_layout(PRESET, num_blocks=BLOCKS, order="block-nhd")
    kv = layout.allocate("cpu")
    memory = reader.register(layout, kv)
    link = reader.connect("notify-owner", metadata, KVLayout.from_bytes(layout_bytes), memory)
    # the first READ over a new endpoint is its wire-up, which needs the owner progressed
    # too: give it time (without any progress in the owner it never finishes)
    first = reader.read_blocks(link, KVGroup.SELF, [0], [0], timeout_s=5)
    warm = True
    try:
        first.wait(5)
    except Exception:
        warm = False
    reads: list[dict[str, Any]] = []
    match = True
    for i in range(n if warm else 0):
        reader.send_notification(link, f"release lease-{i}".encode())
        ids = [(3 * i + k) % BLOCKS for k in range(1 + i % 3)]
        t0 = time.perf_counter()
        handle = reader.read_blocks(link, KVGroup.SELF, ids, ids, timeout_s=1.0)
        at_post = handle.poll() == "done"
        state = handle.poll()
        while state == "pending":
            state = handle.poll()
        ms = (time.perf_counter() - t0) * 1e3 if state == "done" else None
        reads.append({"done_at_post": at_post, "ms": ms})
        if state != "done":
            break
        match = match and all(block_bytes(layout, kv, "self", b) == content[b] for b in ids)
    print(json.dumps({"warm": warm, "reads": reads, "bytes_match": match}), flush=True)
    stop.set()
    owner.join(10)
    reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

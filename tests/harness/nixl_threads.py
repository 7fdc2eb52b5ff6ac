"""Hammer one NixlTransport from several threads; run as a script by test_transport_nixl_threads.

Two agents live in this process: ``target`` owns memory; ``hammered`` is the transport under
test. Threads connect and disconnect links to ``target`` while another registers and
unregisters memory (which scans every link) and a third lists registered regions; then
``close()`` runs while they all still go. Every exception a thread sees is recorded: a typed
``KVBridgeError`` (e.g. "transport is closed") is allowed, anything else (``RuntimeError:
dictionary changed size during iteration``, ``AttributeError`` on a closed agent) is a
defect. Prints one JSON line: what went wrong, what the transport still held after close, and how
many rounds each kind of thread completed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from kvbridge.connector.transport import NixlConfig, NixlTransport
from kvbridge.proto import KVBridgeError, preset_layout


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    layout = preset_layout("tiny", num_blocks=4, order="block-nhd")
    target = NixlTransport(NixlConfig("threads-target", progress_interval_s=None))
    hammered = NixlTransport(NixlConfig("threads-hammered", progress_interval_s=0.001))
    target_mem = target.register(layout, layout.allocate())
    remote = target_mem.layout
    metadata = target.metadata()
    memory = hammered.register(layout, layout.allocate())
    defects: list[str] = []
    done: dict[str, int] = {}
    stop = threading.Event()

    def guarded(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while not stop.is_set():
                try:
                    body()
                    done[body.__name__] = done.get(body.__name__, 0) + 1
                except KVBridgeError:
                    time.sleep(0)  # closed, or a link dropped under us: allowed
                except Exception:
                    defects.append(traceback.format_exc(limit=4))
                    return

        return run

    def links() -> None:
        opened = [hammered.connect("threads-target", metadata, remote, memory) for _ in range(20)]
        for link in opened:
            hammered.disconnect(link)

    def memories() -> None:
        extra = hammered.register(layout, layout.allocate())
        hammered.registered_regions(extra)
        hammered.unregister(extra)

    def regions() -> None:
        hammered.registered_regions(memory)

    threads = [threading.Thread(target=guarded(f)) for f in (links, links, memories, regions)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not defects and time.monotonic() < deadline and rounds > 0:
        time.sleep(0.01)
        rounds -= 1
    closer_error: list[str] = []
    try:
        hammered.close()
    except Exception:
        closer_error.append(traceback.format_exc(limit=4))
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    held: dict[str, Any] = {
        name: len(getattr(hammered, name))
        for name in ("_links", "_peers", "_registrations", "_registered_addrs")
    }
    target.close()
    print(json.dumps({"defects": defects + closer_error, "held_after_close": held, "done": done}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Subscribe to kvbridge's KV events and print which node holds how much, per medium.

Start nodes and daemons with events, e.g.::

    kvbridge serve --role prefill --kv-events tcp://*:5557 --kv-events-replay tcp://*:5558
    kvbridge offload serve --kv-events tcp://*:5567 --kv-events-replay tcp://*:5568

then::

    python examples/kv_events_subscriber.py \\
        --stream prefill=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \\
        --stream offload=tcp://127.0.0.1:5567,tcp://127.0.0.1:5568

Each ``--stream NAME=ENDPOINT[,REPLAY]`` is one publisher (default: one node on
``tcp://127.0.0.1:5557``). With a replay endpoint the subscriber first fetches what the
publisher still buffers, so the map is complete from the start. Every ``--every`` seconds
it prints, per node and medium, how many blocks are held and the first few hashes.

``--demo`` needs no servers: it runs the reference engine in this process with a
publisher on a local socket, subscribes to it, and checks that the printed map is exactly
what the engine's prefix cache holds (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time

from kvbridge.connector.events import (
    MEDIUM_GPU,
    WIRE_VLLM,
    EventSubscriber,
    KVEventsConfig,
    KVEventSource,
    PrefixIndex,
    ZmqEventPublisher,
)


def parse_stream(text: str) -> tuple[str, str, str | None]:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=ENDPOINT[,REPLAY]")
    endpoint, _, replay = rest.partition(",")
    return name, endpoint, replay or None


def render(index: PrefixIndex, show: int) -> str:
    lines = []
    for node in index.nodes():
        for medium in ("GPU", "CPU", "STORAGE"):
            held = index.holds(node, medium)
            if held:
                sample = sorted(h.hex()[:12] if isinstance(h, bytes) else f"{h:016x}" for h in held)
                lines.append(
                    f"{node:>12} {medium:<7} {len(held):6d} blocks  {' '.join(sample[:show])}"
                )
    return "\n".join(lines) or "(no blocks announced yet)"


def follow(streams: list[tuple[str, str, str | None]], seconds: float, every: float, show: int,
           index: PrefixIndex) -> None:  # fmt: skip
    subs = [
        (name, EventSubscriber(ep, replay_endpoint=rep, from_seq=0 if rep else None))
        for name, ep, rep in streams
    ]
    try:
        end = time.monotonic() + seconds if seconds > 0 else float("inf")
        shown = time.monotonic()
        while time.monotonic() < end:
            for name, sub in subs:
                for got in sub.receive(timeout_s=0.05):
                    index.apply(name, got.batch)
            if time.monotonic() - shown >= every:
                print(render(index, show), "\n", flush=True)
                shown = time.monotonic()
    finally:
        for _, sub in subs:
            sub.close()


def demo(show: int) -> int:
    from kvbridge.worker.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        config = KVEventsConfig(endpoint=f"ipc://{tmp}/events", replay_endpoint=f"ipc://{tmp}/r")
        with ZmqEventPublisher(config) as pub:
            engine_config = EngineConfig.preset("tiny", block_size=16, num_blocks=10)
            source = KVEventSource(pub, medium=MEDIUM_GPU, block_size=16, wire=WIRE_VLLM)
            engine = Engine(engine_config, events=source)
            prompts = [[(31 * s + i) % 200 + 1 for i in range(48)] for s in range(4)]
            engine.generate(prompts, 2)  # 4 x 3 blocks in a 10-block pool: some evicted
            pub.flush()
            index = PrefixIndex()
            follow([("engine", pub.endpoint, pub.replay_endpoint)], 1.0, 1.0, show, index)
    pool = engine.pools["self"]
    held = index.holds("engine", MEDIUM_GPU)
    ok = len(held) == pool.num_cached_blocks and all(pool.get_block(h) is not None for h in held)  # type: ignore[arg-type]
    print(f"demo: events show {len(held)} blocks, the engine caches {pool.num_cached_blocks}: "
          + ("match" if ok else "MISMATCH"))  # fmt: skip
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stream", type=parse_stream, action="append", metavar="NAME=ENDPOINT[,REPLAY]")
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: Ctrl-C)")
    p.add_argument("--every", type=float, default=2.0, help="print the map this often (s)")
    p.add_argument("--show", type=int, default=4, help="hashes printed per node and medium")
    p.add_argument("--demo", action="store_true", help="run an engine here and check the map")
    args = p.parse_args(argv)
    if args.demo:
        return demo(args.show)
    streams = args.stream or [("node", "tcp://127.0.0.1:5557", None)]
    with contextlib.suppress(KeyboardInterrupt):
        follow(streams, args.seconds, args.every, args.show, PrefixIndex())
    return 0


if __name__ == "__main__":
    sys.exit(main())

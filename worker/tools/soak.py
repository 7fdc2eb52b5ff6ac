"""``kvbridge soak``: serve through faults for a while and check every token.

Starts ``--nodes P,D`` prefill and decode nodes and one CPU offload daemon as
real processes (on fixed ports, so a restarted process comes back at its
address under its engine id), a :class:`~kvbridge.worker.serving.router.Router`
over them, and ``--concurrency`` client threads sending requests whose prompts
share prefixes. A chaos thread follows a schedule drawn from ``--seed``: one
process at a time is SIGKILLed and restarted, or SIGSTOPped for 0.5-2.5 lease
TTLs (so leases sometimes expire under it) and SIGCONTed. Every answered
output is compared with a single-process run of the same engine.

Exits 1 on any wrong token, any hang (a request past the router's worst-case
deadline), any block, lease or offload pin left behind at the end, or, with a
spare node of each role, any request that got no answer. Progress goes to
stderr; ``--out`` writes the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvbridge.proto.errors import ConfigError
from kvbridge.worker.cli_checks import add_on_load_error, int_at_least, positive_float, positive_int
from kvbridge.worker.serving.node_cmd import add_engine_arguments, engine_config_from_args
from kvbridge.worker.tools.chaos import ChaosEvent, Deployment, chaos_schedule
from kvbridge.worker.tools.soak_config import SoakConfig

__all__ = ["add_parser", "run", "soak"]

Progress = Callable[[str], None]


@dataclass(slots=True)
class _Tally:
    requests: int = 0
    answered: int = 0
    failed: int = 0
    wrong: int = 0
    hangs: int = 0
    retried: int = 0
    recomputed: int = 0
    blocks_moved: int = 0
    blocks_offloaded: int = 0
    blocks_local_hit: int = 0
    latencies_s: list[float] = field(default_factory=list)
    """Of answered requests."""
    errors: list[str] = field(default_factory=list)
    wrong_requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "soak",
        help="serve through random kills and stops; check every token, hang and leak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(p)  # --seed also seeds the workload and the chaos schedule
    p.set_defaults(num_blocks=64)  # small pools: blocks are evicted and reused under load
    p.add_argument(
        "--duration", type=positive_float, default=120.0, help="seconds of load (default 120)"
    )
    p.add_argument(
        "--nodes",
        default="2,2",
        metavar="P,D",
        help="prefill,decode node counts, or one count for both (default 2,2)",
    )
    p.add_argument("--concurrency", type=positive_int, default=2, help="client threads (default 2)")
    p.add_argument(
        "--lease-ttl", type=positive_float, default=3.0, help="nodes' lease TTL (default 3s)"
    )
    p.add_argument(
        "--max-tokens", type=int_at_least(2), default=4, help="tokens per request (default 4)"
    )
    p.add_argument("--no-offload", action="store_true", help="run without an offload daemon")
    add_on_load_error(p)
    p.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=120.0,
        help="seconds each process may take to start (default 120)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        counts = [int(n) for n in str(args.nodes).split(",")]
    except ValueError:
        counts = []
    if len(counts) not in (1, 2):
        raise ConfigError(f"--nodes takes P,D or one count, got {args.nodes!r}")
    if min(counts) < 1:
        raise ConfigError(f"--nodes {args.nodes}: every count must be at least 1, e.g. 2,2")
    config = SoakConfig(
        duration_s=args.duration,
        seed=args.seed,
        prefill_nodes=counts[0],
        decode_nodes=counts[-1],
        concurrency=args.concurrency,
        lease_ttl_s=args.lease_ttl,
        load_timeout_s=min(2.0, args.lease_ttl * 2 / 3),
        max_tokens=args.max_tokens,
        offload=not args.no_offload,
    )
    summary = soak(config, args, lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


def soak(config: SoakConfig, engine_args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """Run one soak; returns the summary (``ok`` is the verdict)."""
    from kvbridge.worker.tools.demo import make_workload, reference_outputs

    engine_args.max_tokens = config.max_tokens
    vocab = engine_config_from_args(engine_args).vocab_size  # type: ignore[attr-defined]
    prompts = make_workload(
        config.prompts, config.prefixes, vocab, engine_args.block_size, config.seed
    )
    progress(f"soak: computing {len(prompts)} single-process reference outputs ...")
    expected = reference_outputs(engine_args, prompts, [None] * len(prompts))
    tally = _Tally()
    with tempfile.TemporaryDirectory(prefix="kvbridge-soak-") as tmp:
        deployment = Deployment(config, engine_args, Path(tmp), progress)
        try:
            deployment.start()
            events = chaos_schedule(config.seed, deployment.targets(), config)
            progress(
                f"soak: {config.prefill_nodes} prefill, {config.decode_nodes} decode"
                f"{', offload daemon' if config.offload else ''}; {config.duration_s:.0f}s, "
                f"seed {config.seed}, {len(events)} chaos events scheduled"
            )
            leaks = _drive(config, deployment, events, prompts, expected, tally, progress)
        finally:
            deployment.close()
    summary: dict[str, Any] = {
        f.name: getattr(tally, f.name) for f in fields(tally) if f.type == "int"
    }
    summary.update(
        kills=deployment.kills,
        stops=deployment.stops,
        chaos=deployment.log,
        leaks=leaks,
        latency_s=_percentiles(tally.latencies_s),
        errors=tally.errors[:20],
        wrong_requests=tally.wrong_requests[:20],
        config=asdict(config),
    )
    summary["ok"] = (
        tally.wrong == 0
        and tally.hangs == 0
        and not leaks
        and tally.requests > 0
        and (tally.failed == 0 or not config.spare)
    )
    progress(
        f"soak: {tally.requests} requests, {tally.answered} answered, {tally.failed} failed, "
        f"{tally.retried} retried, {tally.recomputed} recomputed, {tally.wrong} wrong, "
        f"{tally.hangs} hangs (latency {summary['latency_s']}); {deployment.kills} kills, "
        f"{deployment.stops} stops; "
        f"leaks: {leaks or 'none'} -> {'OK' if summary['ok'] else 'FAILED'}"
    )
    return summary


def _drive(
    config: SoakConfig,
    deployment: Deployment,
    events: list[ChaosEvent],
    prompts: list[list[int]],
    expected: list[list[int]],
    tally: _Tally,
    progress: Progress,
) -> list[str]:
    """Clients and chaos for ``duration_s``; then heal everything and check for leaks."""
    from kvbridge.worker.serving.router import Router, RouterConfig

    router = Router(
        deployment.clients("prefill"),
        deployment.clients("decode"),
        RouterConfig(attempts=config.attempts, attempt_timeout_s=config.attempt_timeout_s),
    )
    stop = threading.Event()
    clients = [
        threading.Thread(
            target=_client,
            args=(k, config, router, prompts, expected, tally, stop, deployment.elapsed),
            name=f"soak-client-{k}",
            daemon=True,
        )
        for k in range(config.concurrency)
    ]
    chaos = threading.Thread(
        target=deployment.run_chaos, args=(events, stop), name="soak-chaos", daemon=True
    )
    deployment.start_clock()
    for thread in (*clients, chaos):
        thread.start()
    while deployment.elapsed() < config.duration_s:
        time.sleep(min(5.0, max(0.1, config.duration_s - deployment.elapsed())))
        with tally.lock:
            progress(
                f"soak: t={deployment.elapsed():5.0f}s requests {tally.requests} answered "
                f"{tally.answered} failed {tally.failed} retried {tally.retried} wrong "
                f"{tally.wrong} hangs {tally.hangs}; kills {deployment.kills} stops "
                f"{deployment.stops}"
            )
    stop.set()
    chaos.join(config.hang_s)
    for thread in clients:
        thread.join(config.hang_s)
        if thread.is_alive():  # a request outlived every deadline the router has
            with tally.lock:
                tally.hangs += 1
                tally.errors.append(f"{thread.name} still inside a request at the end")
    try:  # the router's clients are the deployment's: it closes them
        deployment.heal()
    except Exception as exc:  # a process that cannot come back is a finding, not a crash
        return [f"could not restart every process at the end: {exc}"]
    return deployment.check_no_leaks(timeout_s=3 * config.lease_ttl_s + 30.0)


def _client(
    k: int,
    config: SoakConfig,
    router: Any,
    prompts: list[list[int]],
    expected: list[list[int]],
    tally: _Tally,
    stop: threading.Event,
    clock: Callable[[], float],
) -> None:
    rng = random.Random(config.seed * 1000 + k)
    n = 0
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        rid = f"soak-{k}-{n}"
        n += 1
        t0 = time.monotonic()
        try:
            res = router.generate(prompts[i], config.max_tokens, rid)
        except Exception as exc:  # counted and reported; the soak goes on
            elapsed = time.monotonic() - t0
            with tally.lock:
                tally.requests += 1
                tally.failed += 1
                tally.hangs += elapsed > config.hang_s
                tally.errors.append(f"{rid} after {elapsed:.1f}s: {exc}")
            continue
        elapsed = time.monotonic() - t0
        with tally.lock:
            tally.requests += 1
            tally.answered += 1
            tally.latencies_s.append(elapsed)
            tally.hangs += elapsed > config.hang_s
            tally.retried += res.retries > 0
            d = res.decode
            tally.recomputed += bool(d.load_error or d.blocks_recomputed)
            tally.blocks_moved += d.blocks_moved
            tally.blocks_offloaded += d.blocks_offloaded
            tally.blocks_local_hit += d.blocks_local_hit
            if res.tokens != expected[i]:
                tally.wrong += 1
                tally.wrong_requests.append(
                    {
                        "request_id": rid,
                        "prompt": i,
                        "got": res.tokens,
                        "expected": expected[i],
                        "prefill": res.prefill_address,
                        "decode": res.decode_address,
                        "blocks_local_hit": d.blocks_local_hit,
                        "blocks_moved": d.blocks_moved,
                        "blocks_offloaded": d.blocks_offloaded,
                        "load_error": d.load_error,
                        "at_s": round(clock(), 3),
                    }
                )


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    last = len(ordered) - 1
    at = {"p50": 0.5, "p99": 0.99, "max": 1.0}
    return {k: round(ordered[min(last, int(q * len(ordered)))], 3) for k, q in at.items()}

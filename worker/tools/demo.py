"""``kvbridge demo``: a 1-prefill / 1-decode deployment on loopback, checked token for token.

Starts a prefill node and a decode node (``kvbridge serve`` subprocesses,
pinned to different cores where there are two), routes a few dozen requests
that share prefixes through them, and compares every decode output with a
single-process run of the same engine. Prints per request what moved, writes
JSON with ``--json``, and exits non-zero if any output differs or any block
or lease is left behind.

``--share-last N`` / ``--share-every M`` / ``--prefill-skip`` run a KV-sharing
model (sharing layers are never moved); ``--encoder-decoder`` gives every
request an encoder input drawn from a few clips (``--clips``), so later
requests with the same clip reuse its cross-attention blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvbridge.proto.layout import ORDERS, KVGroup
from kvbridge.worker.bench.report import machine_info
from kvbridge.worker.cli_checks import add_on_load_error, positive_float, positive_int
from kvbridge.worker.serving.launch import (
    OffloadDaemonProcess,
    start_node,
    start_offload_daemon,
)
from kvbridge.worker.serving.node_cmd import add_engine_arguments, engine_config_from_args

__all__ = [
    "add_parser",
    "run",
    "make_workload",
    "make_encoder_inputs",
    "start_node",
    "start_offload_daemon",
    "OffloadDaemonProcess",
    "reference_outputs",
    "check_no_leaks",
]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="run 1 prefill + 1 decode on loopback and check outputs token for token",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(p)
    p.add_argument(
        "--decode-order",
        default=None,
        choices=sorted(ORDERS),
        help="decode's layout order (default: same as --order)",
    )
    p.add_argument(
        "--requests", type=positive_int, default=24, help="number of requests (default 24)"
    )
    p.add_argument(
        "--prefixes", type=positive_int, default=4, help="distinct shared prefixes (default 4)"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=8, help="tokens to generate (default 8)"
    )
    add_on_load_error(p)
    p.add_argument(
        "--clips",
        type=positive_int,
        default=2,
        help="--encoder-decoder: distinct encoder inputs shared by the requests (default 2)",
    )
    p.add_argument("--json", type=Path, default=None, help="write per-request results here")
    p.add_argument(
        "--offload",
        action="store_true",
        help="add a CPU offload daemon; a second pass meets a fresh decode node, which loads "
        "the repeated prompts from the daemon",
    )
    p.add_argument(
        "--offload-capacity",
        default="256MiB",
        help="with --offload: the daemon's host pool (default 256MiB; small, e.g. 256KiB, "
        "to push blocks down to --offload-disk)",
    )
    p.add_argument(
        "--offload-disk",
        metavar="PATH",
        help="with --offload: give the daemon a disk tier in this directory",
    )
    p.add_argument(
        "--offload-disk-capacity", default="1GiB", help="with --offload-disk (default 1GiB)"
    )
    p.add_argument(
        "--offload-restart",
        action="store_true",
        help="with --offload-disk: SIGKILL the daemon after the first pass and start it again "
        "on the same port and disk, so the second pass loads what its disk held",
    )
    p.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=90.0,
        help="seconds each process may take to start (default 90)",
    )
    p.set_defaults(func=run)


def _daemon(args: argparse.Namespace, work: Path, port: int = 0) -> Any:
    from kvbridge.proto.errors import ConfigError

    if args.offload_restart and args.offload_disk is None:
        raise ConfigError("--offload-restart needs --offload-disk (the state that survives)")
    extra = []
    if args.offload_disk is not None:
        extra = ["--disk", args.offload_disk, "--disk-capacity", args.offload_disk_capacity]
    return start_offload_daemon(
        work, args.startup_timeout, capacity=args.offload_capacity, port=port, extra=extra
    )


def make_workload(
    n: int, prefixes: int, vocab: int, block_size: int, seed: int = 0
) -> list[list[int]]:
    """Prompts built from a few shared prefixes (2-5 blocks) plus unique suffixes."""
    rng = random.Random(seed)
    heads = [
        [rng.randrange(vocab) for _ in range(rng.randint(2, 5) * block_size + rng.randrange(4))]
        for _ in range(max(1, prefixes))
    ]
    return [
        heads[i % len(heads)]
        + [rng.randrange(vocab) for _ in range(rng.randint(3, max(3, 2 * block_size)))]
        for i in range(n)
    ]


def make_encoder_inputs(n: int, clips: int, max_len: int, seed: int = 0) -> list[bytes]:
    """Encoder inputs for ``n`` requests, cycling through ``clips`` random byte strings
    (20..min(100, max_len) bytes), so that requests repeat them."""
    rng = random.Random(seed + 7)
    pool = [
        bytes(rng.randrange(256) for _ in range(rng.randint(20, min(100, max_len))))
        for _ in range(max(1, clips))
    ]
    return [pool[i % len(pool)] for i in range(n)]


def reference_outputs(
    args: argparse.Namespace, prompts: list[list[int]], encoder_inputs: list[bytes | None]
) -> list[list[int]]:
    """Greedy outputs of a single-process engine with the same flags: the ground truth."""
    import torch

    from kvbridge.worker.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(engine_config_from_args(args), device=args.device)  # type: ignore[arg-type]
    return [
        engine.generate([p], args.max_tokens, [e])[0]
        for p, e in zip(prompts, encoder_inputs, strict=True)
    ]


def check_offload_flags(args: argparse.Namespace) -> None:
    """ConfigError naming the flag for an ``--offload-*`` flag without ``--offload`` (it would
    be ignored) or a size the daemon would refuse, before the reference run and the nodes."""
    from kvbridge.proto.errors import ConfigError
    from kvbridge.worker.offload.cmd import parse_bytes

    flags = {"capacity": "256MiB", "disk": None, "disk_capacity": "1GiB", "restart": False}
    given = [k for k, default in flags.items() if getattr(args, f"offload_{k}") != default]
    if given and not args.offload:
        flag = "--offload-" + given[0].replace("_", "-")
        raise ConfigError(f"{flag} needs --offload (the daemon it configures); add --offload")
    if args.offload_restart and args.offload_disk is None:
        raise ConfigError("--offload-restart needs --offload-disk (the state that survives)")
    parse_bytes(args.offload_capacity, "--offload-capacity")
    parse_bytes(args.offload_disk_capacity, "--offload-disk-capacity")


def run(args: argparse.Namespace) -> int:
    check_offload_flags(args)
    config: Any = engine_config_from_args(args)  # flags first: a bad one imports no torch

    from kvbridge.worker.serving.router import EngineClient, Router

    prompts = make_workload(
        args.requests, args.prefixes, config.vocab_size, args.block_size, args.seed
    )
    encoder_inputs: list[bytes | None] = (
        list(make_encoder_inputs(args.requests, args.clips, config.max_encoder_len, args.seed))
        if config.encoder_decoder
        else [None] * len(prompts)
    )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    p_core, d_core = (cores[0], cores[1]) if len(cores) >= 2 else (None, None)
    print(
        f"kvbridge demo: {args.requests} requests, model {args.model}, block size "
        f"{args.block_size}, prefill {args.order} -> decode {args.decode_order or args.order}"
    )
    layout = config.layout()
    print(layout.describe())
    print("computing single-process reference outputs ...", flush=True)
    expected = reference_outputs(args, prompts, encoder_inputs)
    rows: list[dict[str, Any]] = []
    leaks: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        extra: list[str] = []
        if args.offload:
            offload = stack.enter_context(_daemon(args, work))
            daemon = offload.address
            extra = ["--offload", daemon]
            print(f"offload daemon at {daemon}")
        token = secrets.token_hex(16)  # both nodes require it; the router sends it
        _, pinfo = stack.enter_context(
            start_node("prefill", args, args.order, work, p_core, extra, token=token)
        )
        prefill = EngineClient(pinfo["inference"], token=token)
        stack.callback(prefill.close)
        passes = 2 if args.offload else 1
        for n in range(passes):
            if n == 1 and args.offload_restart:
                offload.kill()  # SIGKILL: its host pool is gone, its disk tier is not
                port = int(daemon.rsplit(":", 1)[1])
                stack.enter_context(_daemon(args, work, port))
                print(f"offload daemon SIGKILLed and restarted at {daemon}")
            # with --offload the second pass meets a fresh decode node: its prompts come back
            # from the offload daemon instead of prefill's memory
            with start_node(
                f"decode{n}",
                args,
                args.decode_order or args.order,
                work,
                d_core,
                # the decode names its prefill (as a deployment that limits dialing does):
                # it links to it at start, so not even request 0 waits for the first link
                [*extra, "--allow-peer", pinfo["control"]],
                role="decode",
                token=token,
            ) as (_, dinfo):
                decode = EngineClient(dinfo["inference"], token=token)
                print(
                    f"\npass {n + 1}: prefill at {pinfo['inference']} (control "
                    f"{pinfo['control']}), decode at {dinfo['inference']}\n"
                )
                rows += _run_pass(
                    Router([prefill], [decode]),
                    prompts,
                    encoder_inputs,
                    expected,
                    args.max_tokens,
                    n + 1,
                )
                leaks += check_no_leaks({"prefill": prefill, f"decode (pass {n + 1})": decode})
                decode.close()
    summary = {
        "requests": len(rows),
        "all_match": all(r["tokens_match"] for r in rows),
        "blocks_moved": sum(r["blocks_moved"] for r in rows),
        "blocks_moved_by_group": _sum_groups(rows),
        "bytes_moved": sum(r["bytes_moved"] for r in rows),
        "blocks_local_hit": sum(r["blocks_local_hit"] for r in rows),
        "blocks_offloaded": sum(r["blocks_offloaded"] for r in rows),
        "blocks_recomputed": sum(r["blocks_recomputed"] for r in rows),
        "leaks": leaks,
    }
    print(
        f"\nall_match: {str(summary['all_match']).lower()}; moved {summary['blocks_moved']} "
        f"blocks {summary['blocks_moved_by_group']} ({summary['bytes_moved'] / 2**20:.2f} MiB), "
        f"decode hit {summary['blocks_local_hit']} locally, loaded "
        f"{summary['blocks_offloaded']} from the offload daemon, recomputed "
        f"{summary['blocks_recomputed']}; leaks: {leaks or 'none'}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine_info(),
                    "settings": _settings(args),
                    "requests": rows,
                    "summary": summary,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.json}")
    return 0 if summary["all_match"] and not leaks else 1


def _run_pass(
    router: Any,
    prompts: list[list[int]],
    encoder_inputs: list[bytes | None],
    expected: list[list[int]],
    max_tokens: int,
    pass_no: int,
) -> list[dict[str, Any]]:
    """Route every prompt, print a line per request, return the rows."""
    print(
        f"{'req':>4} {'prompt':>6} {'hit':>4} {'moved':>5} {'cross':>5} {'offl':>4} {'KiB':>7} "
        f"{'recomp':>6} {'xfer_ms':>8} {'prefill_ms':>10}  match"
    )
    rows = []
    for i, prompt in enumerate(prompts):
        rid = f"demo-{pass_no}-{i}"
        try:
            res = router.generate(prompt, max_tokens, rid, encoder_inputs[i] or b"")
            tokens, d, ttft = res.tokens, res.decode, res.ttft_ms
            error = d.load_error
        except Exception as exc:  # the demo reports failures per request
            tokens, d, ttft, error = [], None, 0.0, str(exc)
        row: dict[str, Any] = {
            "request_id": rid,
            "pass": pass_no,
            "prompt_tokens": len(prompt),
            "blocks_local_hit": d.blocks_local_hit if d else 0,
            "blocks_moved": d.blocks_moved if d else 0,
            "blocks_moved_by_group": dict(d.blocks_moved_by_group) if d else {},
            "blocks_offloaded": d.blocks_offloaded if d else 0,
            "bytes_moved": d.bytes_moved if d else 0,
            "decode_cross_source": d.cross_source if d else "",
            "blocks_recomputed": d.blocks_recomputed if d else 0,
            "transfer_ms": round(d.transfer_ms, 3) if d else 0.0,
            # the router's time to prefill's first token (decode's load is not in it)
            "prefill_ttft_ms": round(ttft, 3),
            "tokens_match": tokens == expected[i],
            "load_error": error,
        }
        rows.append(row)
        print(
            f"{i:>4} {row['prompt_tokens']:>6} {row['blocks_local_hit']:>4} "
            f"{row['blocks_moved']:>5} {_cross_cell(row):>5} {row['blocks_offloaded']:>4} "
            f"{row['bytes_moved'] / 1024:>7.0f} {row['blocks_recomputed']:>6} "
            f"{row['transfer_ms']:>8.2f} {row['prefill_ttft_ms']:>10.2f}  "
            f"{'yes' if row['tokens_match'] else 'NO'}" + (f"  ({error})" if error else ""),
            flush=True,
        )
    return rows


def _cross_cell(row: dict[str, Any]) -> str:
    """Cross blocks moved, or where decode's cross KV came from when none moved."""
    moved = row["blocks_moved_by_group"].get(KVGroup.CROSS, 0)
    source = row["decode_cross_source"]
    if not source:
        return "-"
    return str(moved) if source == "loaded" else source


def _sum_groups(rows: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in rows:
        for group, n in r["blocks_moved_by_group"].items():
            total[group] = total.get(group, 0) + n
    return total


def check_no_leaks(clients: dict[str, Any], timeout_s: float = 10.0) -> list[str]:
    """Every pool back to full and no lease left, within ``timeout_s`` (releases are async)."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = []
        for name, client in clients.items():
            stats = client.stats()
            for group, total in stats.total_blocks.items():
                free = stats.free_blocks[group]
                if free != total:
                    problems.append(f"{name}: {total - free} of {total} '{group}' blocks in use")
            if stats.active_leases:
                problems.append(f"{name}: {stats.active_leases} leases held")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.1)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}

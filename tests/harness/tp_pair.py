"""A vLLM-like prefill or decode of some TP size, without vLLM: kvbridge's worker halves over
real NIXL and real gRPC, each process one side (heterogeneous TP with verified head slices).

Started by ``tests/test_tp_ranks.py`` and ``tests/test_attack_nixl_write.py`` through
:class:`Prefill` and :func:`run_decode` (the test process loads no NIXL):

- ``python -m tests.harness.tp_pair prefill TP PORT``: ``TP`` producer workers (ranks
  ``0..TP-1``, control at ``PORT + rank``) over vLLM's packed head-major pages (``LBHNC``,
  the ``(B, H, N, 2C)`` per-layer views vLLM hands ``register_kv_caches``), filled from one
  seeded tensor of every head; the scheduler hands one request over (hold orders to every
  rank) and the process prints ``{"params": ...}`` on one line, then serves until stdin
  closes.
- ``python -m tests.harness.tp_pair decode TP PARAMS_JSON``: ``TP`` consumer workers plan
  and run the load those params name, wait for every rank to finish, and print one JSON line:
  per rank what it moved and recomputed, its error and digest mismatches, which loaded
  blocks differ from the prefill's KV (byte for byte against the same seeded tensor), the
  path that proved them, and how many ``Digests`` RPCs the process made.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvbridge.connector import StepMetadata
from kvbridge.connector.vllm.config import VllmConnectorConfig
from kvbridge.connector.vllm.scheduler import VllmScheduler
from kvbridge.connector.vllm.views import logical_views, packed_suffix
from kvbridge.connector.vllm.worker import VllmWorker, WorkerSettings
from kvbridge.proto import BlockId, KVLayout, RequestId

LAYERS, HEADS, HEAD_SIZE, BS, BLOCKS = 2, 4, 8, 16, 8
PROMPT = list(range(1, 3 * BS + 6))  # 3 full blocks and a partial one
PREFILL_IDS = [BlockId(b) for b in (5, 2, 7, 0)]
DECODE_IDS = [BlockId(b) for b in (1, 3, 4, 6)]
MODEL = "tiny-tp"
PRODUCER = {"lease_ttl_s": 300}
"""A lease outlives the decode process's start-up on a loaded machine (30 s by default)."""


def every_head() -> torch.Tensor:
    """The prefill's KV of every head: ``(L, B, H, N, 2C)``, the same in every process."""
    gen = torch.Generator().manual_seed(11)
    return torch.randn((LAYERS, BLOCKS, HEADS, BS, 2 * HEAD_SIZE), generator=gen)


def _worker(role: str, rank: int, size: int, port: int, buf: torch.Tensor) -> VllmWorker:
    extra: dict[str, Any] = {"control_port": port, **PRODUCER} if role == "kv_producer" else {}
    cfg = VllmConnectorConfig.from_vllm(role, f"{role}-tp{size}", extra, model=MODEL)
    settings = WorkerSettings(MODEL, BS, control_port=port, tp_rank=rank, tp_size=size)
    worker = VllmWorker(cfg.connector, settings)
    caches = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}
    views, interior = logical_views(
        caches, num_kv_heads=HEADS // size, head_size=HEAD_SIZE, block_size=BS
    )
    assert interior is not None
    worker.settings = WorkerSettings(
        MODEL + packed_suffix(interior), BS, control_port=port, tp_rank=rank, tp_size=size
    )
    worker.register(views)
    return worker


def claimed_layout(rank: int, size: int) -> KVLayout:
    """The (unbound) layout of rank ``rank`` of a TP-``size`` engine of this model: what a
    token holder that knows the model claims in a handshake."""
    buf = torch.zeros((LAYERS, BLOCKS, HEADS // size, BS, 2 * HEAD_SIZE))
    caches = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}
    views, interior = logical_views(
        caches, num_kv_heads=HEADS // size, head_size=HEAD_SIZE, block_size=BS
    )
    assert interior is not None
    layout = KVLayout.from_tensors(
        views,
        model_name=MODEL + packed_suffix(interior),
        block_size=BS,
        tp_rank=rank,
        tp_size=size,
    )
    return dataclasses.replace(layout, regions=())


def _scheduler(role: str, size: int, port: int) -> VllmScheduler:
    extra: dict[str, Any] = {"control_port": port, **PRODUCER} if role == "kv_producer" else {}
    cfg = VllmConnectorConfig.from_vllm(role, f"{role}-tp{size}", extra, model=MODEL)
    hasher = cfg.hasher(
        dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD_SIZE, block_size=BS
    )
    return VllmScheduler(cfg.connector, BS, hasher, None, size)


def _slice(size: int, rank: int) -> slice:
    per = HEADS // size
    return slice(rank * per, (rank + 1) * per)


def prefill(size: int, port: int) -> int:
    kv = every_head()
    bufs = [kv[:, :, _slice(size, r)].contiguous() for r in range(size)]
    workers = [_worker("kv_producer", r, size, port, bufs[r]) for r in range(size)]
    try:
        sched = _scheduler("kv_producer", size, port)
        rid = RequestId("p1")
        _, params = sched.request_finished(
            rid, PROMPT, {"do_remote_decode": True}, PREFILL_IDS, True
        )
        _, orders = sched.build_step()
        for w in workers:
            w.start_step(StepMetadata(loads=(), stores=()), orders)
        print(json.dumps({"params": params}), flush=True)
        sys.stdin.read()  # serve until the test closes stdin
    finally:
        for w in workers:
            w.close()
    return 0


def _count_digests_calls() -> list[int]:
    """Count the ``Digests`` RPCs this process makes, waited for or sent without waiting
    (a load proved by its seal's content tag makes none)."""
    from kvbridge.connector.control import ControlClient

    calls = [0]
    ask, send = ControlClient.digests, ControlClient.digests_call

    def counted(self: ControlClient, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return ask(self, *args, **kwargs)

    def counted_call(self: ControlClient, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return send(self, *args, **kwargs)

    ControlClient.digests = counted  # type: ignore[method-assign]
    ControlClient.digests_call = counted_call  # type: ignore[method-assign]
    return calls


def decode(size: int, raw: str) -> int:
    params = json.loads(raw)
    digests_calls = _count_digests_calls()
    bufs = [torch.zeros((LAYERS, BLOCKS, HEADS // size, BS, 2 * HEAD_SIZE)) for _ in range(size)]
    workers = [_worker("kv_consumer", r, size, 0, bufs[r]) for r in range(size)]
    out: list[dict[str, Any]] = []
    try:
        sched = _scheduler("kv_consumer", size, 0)
        rid = RequestId("d1")
        matched, _ = sched.num_matched(rid, PROMPT, params, 0)
        sched.after_alloc(rid, PROMPT, DECODE_IDS, matched)
        step, _ = sched.build_step()
        for w in workers:
            w.start_step(step, [])
        kv = every_head()
        for rank, w in enumerate(workers):
            deadline = time.monotonic() + 60
            while rid not in w.results and time.monotonic() < deadline:
                w.get_finished()
                time.sleep(0.005)
            result = w.results[rid]
            bad = set(result.bad_block_ids)
            wrong = [
                i
                for i, (lb, pb) in enumerate(zip(DECODE_IDS, PREFILL_IDS, strict=True))
                if lb not in bad
                and not torch.equal(bufs[rank][:, lb], kv[:, pb, _slice(size, rank)])
            ]
            out.append(
                {
                    "moved": result.blocks_moved,
                    "bad": [DECODE_IDS.index(b) for b in result.bad_block_ids],
                    "mismatches": result.digest_mismatches,
                    "verified": result.verified,
                    "error": result.error,
                    "wrong": wrong,
                    "path": result.path,
                }
            )
    finally:
        for w in workers:
            w.close()
    for rank in out:
        rank["digests_calls"] = digests_calls[0]  # the process's, all ranks together
    print(json.dumps({"ranks": out}), flush=True)
    return 0


# ----- the test side ------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib")}


def _free_ports(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` free (a TP-``n`` prefill's control ports)."""
    for _ in range(50):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            p = int(socks[0].getsockname()[1])
            for i, sock in enumerate(socks[1:], 1):
                sock.bind(("127.0.0.1", p + i))
            return p
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} free consecutive ports")


class Prefill:
    """A prefill process of ``tp`` ranks that handed one request over (:attr:`params`);
    :meth:`close` always ends it."""

    def __init__(self, tp: int) -> None:
        self.port = _free_ports(tp)
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.tp_pair", "prefill", str(tp), str(self.port)],
            cwd=ROOT,
            env=_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL logs to stdout too
            if line.startswith('{"params"'):
                self.params: dict[str, Any] = json.loads(line)["params"]
                # keep draining stdout so the process never blocks on a full pipe
                self._drain = threading.Thread(target=self.proc.stdout.read, daemon=True)
                self._drain.start()
                return
        self.close()
        self.log.seek(0)
        raise AssertionError(f"the prefill exited: {self.log.read()[-4000:]}")

    def address(self, rank: int) -> str:
        return f"127.0.0.1:{self.port + rank}"

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "_drain"):
            self._drain.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def run_decode(tp: int, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Load ``params``' request into a decode of ``tp`` ranks: each rank's report."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.harness.tp_pair", "decode", str(tp), json.dumps(params)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith('{"ranks"')][-1]
    ranks: list[dict[str, Any]] = json.loads(line)["ranks"]
    return ranks


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if sys.argv[1] == "prefill":
        return prefill(int(sys.argv[2]), int(sys.argv[3]))
    return decode(int(sys.argv[2]), sys.argv[3])


if __name__ == "__main__":
    raise SystemExit(main())

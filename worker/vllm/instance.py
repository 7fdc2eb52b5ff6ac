"""One offline vLLM engine driven over stdin/stdout (JSON lines), for tests and benchmarks.

Runs inside the vLLM virtual environment (``.venv-vllm``), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the engine's scheduler and
kvbridge's connector halves can be inspected. Between commands it keeps
stepping the engine while it has work (a prefill holding blocks for decode
must keep reporting ``done_sending``), like a server would.

Commands, one JSON object per line; each gets one answer line, ``KVB-JSON {...}``::

    {"cmd": "generate", "prompts": [[ids...], ...], "max_tokens": 8, "params": [obj|null, ...]}
    {"cmd": "stats"}     # blocks in use, leases held, per-request load results
    {"cmd": "metrics"}   # the Prometheus text vLLM's /metrics serves (with --log-stats)
    {"cmd": "drain", "timeout_s": 10}   # step until nothing is held or running
    {"cmd": "quit"}

Start (in ``.venv-vllm``): ``python -m kvbridge.worker.vllm.instance --model DIR
[--kv-transfer-config JSON] [--log-stats] [--tensor-parallel-size N] [--cpu-kv-layouts L,...]``;
its first answer line is ``{"ready": true, ...}``. ``--log-stats`` turns on vLLM's stat
loggers (the periodic log line and the Prometheus metrics), which an offline engine leaves
off. With ``--tensor-parallel-size`` above 1 vLLM runs one worker process per rank (``mp``
executor): the worker connectors live there, so ``stats`` reports only what the scheduler
sees (blocks in use, requests; ``"tp"``) and the loads are read from vLLM's own
KV-connector stats (``--log-stats`` and ``metrics``).
``--cpu-kv-layouts BLHNC,LBHNC`` is a **test-only shim**: before the engine is built it
makes vLLM's CPU attention backend declare those KV cache layouts (it declares only
``LBHNC``), so that a connector's request for a block-outermost layout is honoured on
CPU. vLLM upstream would need the CPU backend to declare ``BLHNC`` itself
(``docs/VLLM.md``).
:class:`kvbridge.worker.vllm.Engine` does that from the main environment.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from collections.abc import Callable
from typing import Any

from kvbridge.worker.vllm.engine import PREFIX


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def declare_cpu_kv_layouts(names: list[str]) -> None:
    """Test-only: make ``CPU_ATTN`` declare ``names`` (vLLM KVCacheLayout names, most
    preferred first). In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) build the
    worker after this, so it reports these layouts to the layout resolution."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layouts = tuple(KVCacheLayout[n] for n in names)
    CPUAttentionBackend.supported_kv_cache_layouts = classmethod(  # type: ignore[method-assign]
        lambda cls: layouts
    )


class Instance:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM

        if args.cpu_kv_layouts:
            declare_cpu_kv_layouts(args.cpu_kv_layouts.split(","))

        kw: dict[str, Any] = {}
        if args.tensor_parallel_size > 1:  # one worker process per rank (gloo on CPU)
            kw["distributed_executor_backend"] = "mp"
        if args.kv_transfer_config:
            from vllm.config import KVTransferConfig

            kw["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv_transfer_config))
        if args.kv_events_config:
            from vllm.config import KVEventsConfig

            kw["kv_events_config"] = KVEventsConfig(**json.loads(args.kv_events_config))
        t0 = time.perf_counter()
        self.llm = LLM(
            model=args.model,
            skip_tokenizer_init=not args.tokenizer,
            dtype="float32",
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=16,
            enable_prefix_caching=True,
            enforce_eager=True,
            seed=0,
            disable_log_stats=not args.log_stats,
            tensor_parallel_size=args.tensor_parallel_size,
            **kw,
            **json.loads(args.llm_args or "{}"),
        )
        self.startup_s = time.perf_counter() - t0
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = self.core.scheduler
        self.nixl_transfer_s: list[float] = []
        self.nixl_post_s: list[float] = []
        self.nixl_failed = 0
        self.nixl_descriptors: list[int] = []
        self.nixl_bytes: list[int] = []
        self.load_spans: dict[str, float] = {}
        """Per request, ms from the ``start_load_kv`` that started its load to the
        ``get_transfer_results`` that reported it received, timed here the same way for
        every connector (what a load costs the engine)."""
        self._load_started: dict[str, float] = {}
        conn = self._worker_connector()
        if conn is not None and not hasattr(conn, "_worker"):
            self._tap_stats(conn)
        if conn is not None and args.tensor_parallel_size == 1:
            self._tap_loads(conn)

    def _tap_loads(self, conn: Any) -> None:
        """Time each load from the engine's side (:attr:`load_spans`): the requests a step's
        ``start_load_kv`` starts (NixlConnector's ``reqs_to_recv``, kvbridge's loads) until
        ``get_transfer_results`` names them in ``finished_recving``."""
        start, results = conn.start_load_kv, conn.get_transfer_results

        def started(*args: Any, **kwargs: Any) -> Any:
            now = time.perf_counter()
            meta = conn._get_connector_metadata()
            rids = list(getattr(meta, "reqs_to_recv", {}))  # NixlConnector
            step = getattr(meta, "step", None)  # kvbridge
            rids += [str(load.request_id) for load in getattr(step, "loads", ())]
            for rid in rids:
                self._load_started.setdefault(rid, now)
            return start(*args, **kwargs)

        def reported(*args: Any, **kwargs: Any) -> Any:
            out = results(*args, **kwargs)
            now = time.perf_counter()
            for rid in out.finished_recving or ():
                t0 = self._load_started.pop(rid, None)
                if t0 is not None:
                    self.load_spans[rid] = (now - t0) * 1e3
            return out

        conn.start_load_kv, conn.get_transfer_results = started, reported

    def _tap_stats(self, conn: Any) -> None:
        """Keep a copy of NixlConnector's transfer durations, descriptors, bytes and failed
        transfers and handshakes (the engine drains its stats)."""
        original = conn.get_kv_connector_stats

        def tapped() -> Any:
            stats = original()
            if stats is not None:
                self.nixl_transfer_s.extend(stats.data.get("transfer_duration", []))
                self.nixl_post_s.extend(stats.data.get("post_duration", []))
                self.nixl_descriptors.extend(stats.data.get("num_descriptors", []))
                self.nixl_bytes.extend(stats.data.get("bytes_transferred", []))
                for key in ("num_failed_transfers", "num_failed_handshakes"):
                    self.nixl_failed += len(stats.data.get(key, []))
            return stats

        conn.get_kv_connector_stats = tapped

    # ----- helpers -------------------------------------------------------------------------
    def _worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def pump(self) -> None:
        """One engine step if there is work (delayed frees, running requests)."""
        if self.scheduler.has_requests():
            self.core.step()

    # ----- commands ------------------------------------------------------------------------
    def generate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = cmd["prompts"]
        params = cmd.get("params") or [None] * len(prompts)
        sps = []
        for p in params:
            extra = {"kv_transfer_params": p} if p else None
            sps.append(
                SamplingParams(
                    max_tokens=cmd.get("max_tokens", 8),
                    temperature=0.0,
                    detokenize=False,
                    ignore_eos=True,
                    extra_args=extra,
                )
            )
        t0 = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=x) for x in prompts], sps, use_tqdm=False
        )
        wall_ms = (time.perf_counter() - t0) * 1e3
        return {
            "wall_ms": wall_ms,
            "outputs": [
                {
                    "request_id": o.request_id,
                    "tokens": list(o.outputs[0].token_ids),
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outs
            ],
        }

    def stats(self) -> dict[str, Any]:
        pool = self.scheduler.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        out: dict[str, Any] = {
            "startup_s": self.startup_s,
            "switch_interval_s": sys.getswitchinterval(),
            "blocks_in_use": total - pool.get_num_free_blocks(),
            "total_blocks": total,
            "requests": len(self.scheduler.requests),
            "tp": self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
            # vLLM's KV cache groups, by spec kind (several: its hybrid KV cache manager is on)
            "kv_cache_groups": [
                type(g.kv_cache_spec).__name__
                for g in self.scheduler.kv_cache_config.kv_cache_groups
            ],
        }
        conn = self._worker_connector()
        worker = getattr(conn, "_worker", None)
        if worker is not None:
            out["held_requests"] = len(worker.held)
            out["leases"] = 0 if worker.leases is None else len(worker.leases)
            out["pending_sends"] = worker.pending_sends
            lay = worker.layout
            if lay is not None:
                out["layout"] = {
                    "order": " ".join(lay.order),
                    "kind": lay.kind,
                    "regions": lay.num_regions,
                    "descriptors_per_block": lay.descriptors_per_block(),
                    "block_bytes": lay.block_bytes(),
                    "model": lay.model.name,
                    "wire": lay.to_bytes().hex(),  # what a handshake with this engine sends
                }
            out["loads"] = {
                rid: {
                    "requested": r.blocks_requested,
                    "moved": r.blocks_moved,
                    "offloaded": r.blocks_offloaded,
                    "transfer_ms": r.transfer_ms,
                    "bytes": r.bytes_moved,
                    "descriptors": r.descriptors,
                    "wire_descriptors": r.wire_descriptors,
                    "read_ms": r.read_ms,
                    "post_ms": r.post_ms,
                    "steps": [(step, (at - r.steps[0][1]) * 1e3) for step, at in r.steps],
                    "link_ms": r.link_ms,
                    "path": r.path,
                    "error": r.error,
                    "verified": r.verified,
                    "digest_mismatches": r.digest_mismatches,
                }
                for rid, r in worker.results.items()
            }
        elif conn is not None:
            out["nixl_transfer_s"], self.nixl_transfer_s = self.nixl_transfer_s, []
            out["nixl_post_s"], self.nixl_post_s = self.nixl_post_s, []
            out["nixl_failed"], self.nixl_failed = self.nixl_failed, 0
            out["nixl_descriptors"], self.nixl_descriptors = self.nixl_descriptors, []
            out["nixl_bytes"], self.nixl_bytes = self.nixl_bytes, []
        out["load_spans"], self.load_spans = self.load_spans, {}
        return out

    def metrics(self) -> dict[str, Any]:
        import prometheus_client

        return {"text": prometheus_client.generate_latest().decode()}

    def drain(self, cmd: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + float(cmd.get("timeout_s", 10))
        while self.scheduler.has_requests() and time.monotonic() < deadline:
            self.core.step()
            time.sleep(0.005)
        return self.stats()


def main() -> None:
    # before vLLM (imported by Instance) reads them
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("UCX_MODULES", "^ib")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-transfer-config", default="")
    parser.add_argument("--kv-events-config", default="", help="vLLM's, as JSON")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--log-stats", action="store_true")
    parser.add_argument("--cpu-kv-layouts", default="", help="test-only shim, e.g. BLHNC,LBHNC")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--llm-args", default="", help="more vllm.LLM keyword arguments, JSON")
    parser.add_argument(
        "--tokenizer", action="store_true", help="load the model's tokenizer (Whisper needs it)"
    )
    args = parser.parse_args()
    inst = Instance(args)
    _reply({"ready": True, "startup_s": inst.startup_s})
    step_now = False
    while True:
        if step_now:  # outside the try: a failing step must not answer a command twice
            step_now = False
            inst.pump()
        ready, _, _ = select.select([sys.stdin], [], [], 0.002)
        if not ready:
            inst.pump()
            continue
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                _reply({"ok": True})
                return
            handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
                "generate": inst.generate,
                "stats": lambda c: inst.stats(),
                "metrics": lambda c: inst.metrics(),
            }
            handler = handlers.get(cmd["cmd"])
            if cmd["cmd"] == "drain":
                _reply(inst.drain(cmd))
            elif handler is None:
                _reply({"error": f"unknown command {cmd['cmd']!r}"})
            else:
                _reply(handler(cmd))
                # a server's engine core steps again as soon as a step's outputs are out
                # (the step that tells the workers which requests finished, where a kvbridge
                # prefill leases and seals their blocks), not at the next poll of the
                # command pipe up to 2 ms later
                step_now = cmd["cmd"] == "generate"
        except Exception as exc:  # report, keep serving: the driver decides
            _reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()

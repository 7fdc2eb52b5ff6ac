"""``kvbridge bench load``: one decode load, with and without control RPCs, in one run.

An owner process holds a KV pool, a lease table with its seal table, a
PeerControl server and a release listener; this process reads from it as a
decode does, request after request, alternating the two load protocols:

- ``owner`` (what every load did before lease seals, and the slow path now):
  Pin by request id (the owner names the blocks), READ, Release (its answer
  confirms the lease held): two blocking RPCs around the READ;
- ``sealed``: READ, READ of the lease's seal slots, release by NIXL notification:
  no RPC;
- ``verified`` (what a decode load does by default): ``sealed`` plus the check of
  every block read against the digest its owner recorded at hand-over (keyed
  XXH3-128 of the bytes as they landed, computed while the seal READ is in flight;
  ``--no-verify`` leaves it out, and the JSON settings say which).

Each is timed against a bare READ of the same blocks (``read``), for 1 to 6
blocks of the chosen preset, so the figure is what a protocol adds to the READ.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

from kvbridge.proto.layout import KVGroup
from kvbridge.worker.bench.cli_args import add_output_arguments, output_paths, settings_of
from kvbridge.worker.bench.report import bar_plot, machine_info, print_table, write_json
from kvbridge.worker.cli_checks import add_preset_argument, positive_int

__all__ = ["add_parser", "run"]

PROTOCOLS = ("read", "sealed", "verified", "owner")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("load", help="one decode load: sealed (no RPC) vs owner-named (2 RPCs)")
    add_preset_argument(p, "layout preset", "tiny")
    p.add_argument("--blocks", type=positive_int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--requests", type=positive_int, default=200, help="loads per protocol and size")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="leave out the verified sealed load (digest check of the blocks read)",
    )
    p.add_argument(
        "--no-digest-helper",
        dest="digest_helper",
        action="store_false",
        help="hash every block of a verified load in the loading thread (no helper thread)",
    )
    add_output_arguments(p, "load")
    p.set_defaults(func=run)


def _owner(preset: str, leases: int, blocks: int, per_lease: int, out: Any, stop: Any) -> None:
    """The owner process: pool, seal table, control server, release listener."""
    import torch

    from kvbridge.connector.control import LeaseTable, PeerInfo, Role, serve
    from kvbridge.connector.control.leases import BlockOwner, GroupBlocks, GroupHashes
    from kvbridge.connector.control.releases import ReleaseListener
    from kvbridge.connector.control.seal import SealTable
    from kvbridge.connector.transport import NixlConfig, NixlTransport
    from kvbridge.kernels import block_digests, new_key
    from kvbridge.proto import BlockHash, BlockId, EngineId, RequestId, preset_layout

    class Owner(BlockOwner):  # the blocks stay put: the bench never reuses them
        def num_blocks(self, group: KVGroup) -> int:
            return layout.group(group).num_blocks if group == KVGroup.SELF else 0

        def pin_hashes(self, group_hashes: GroupHashes) -> dict[KVGroup, list[BlockId]]:
            return {g: [] for g in group_hashes}

        def unpin(self, blocks: GroupBlocks) -> None:
            pass

    layout = preset_layout(preset, num_blocks=blocks)
    with NixlTransport(NixlConfig("bench-owner")) as transport:
        caches = layout.allocate("cpu")
        for tensor in caches.values():
            tensor.copy_(torch.randn(tensor.shape).to(tensor.dtype))
        memory = transport.register(layout, caches)
        key = new_key()  # the hand-over's digests, as a prefill records them
        digests = block_digests(memory.layout, KVGroup.SELF, list(range(blocks)), key)
        seal = SealTable(64 * leases)  # sparse: every lease finds a free probe slot
        seal_memory = transport.register(seal.layout, seal.tensors)
        table = LeaseTable(Owner(), seal=seal)
        info = PeerInfo(
            EngineId("bench-owner"), Role.PREFILL, memory.layout, transport.metadata(),
            seal_layout=seal_memory.layout,
        )  # fmt: skip
        server = serve(info, table)
        listener = ReleaseListener(transport, table.release)
        names = [BlockHash(bytes([i % 256]) * 32) for i in range(blocks)]
        made = []
        for i in range(leases):
            ids = [BlockId((i * 7 + j) % blocks) for j in range(per_lease)]
            lease = table.create(
                {KVGroup.SELF: ids},
                ttl_s=600,
                hashes={KVGroup.SELF: names[:per_lease]},
                request_id=RequestId(f"r{i}"),
            )
            made.append((lease.lease_id, ids))
        out.put((server.address, made, [bytes(n) for n in names[:per_lease]], key, digests))
        stop.get()
        listener.close()
        server.close()


def run(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.connector.control import ControlClient, PeerInfo, Role
    from kvbridge.connector.control.seal import seal_digest
    from kvbridge.connector.control.seal_reader import SealReader
    from kvbridge.connector.load.verify import Expected
    from kvbridge.connector.transport import NixlConfig, NixlTransport
    from kvbridge.proto import BlockHash, BlockId, EngineId, LeaseId, RequestId, preset_layout

    per_size = args.requests
    protocols = [p for p in PROTOCOLS if args.verify or p != "verified"]
    leases_needed = (len(protocols) - 1) * per_size * len(args.blocks)
    per_lease = max(args.blocks)
    num_blocks = max(64, 8 * per_lease)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Queue()
    owner = ctx.Process(
        target=_owner,
        args=(args.preset, leases_needed, num_blocks, per_lease, out, stop),
        daemon=True,
    )
    owner.start()
    rows: list[dict[str, Any]] = []
    try:
        address, made, raw_names, key, digests = out.get(timeout=300)
        names = [BlockHash(n) for n in raw_names]
        layout = preset_layout(args.preset, num_blocks=num_blocks)
        with (
            NixlTransport(NixlConfig("bench-reader")) as transport,
            ThreadPoolExecutor(1) as helper,
        ):
            memory = transport.register(layout, layout.allocate("cpu"))
            reader = SealReader(transport, 1)
            client = ControlClient(address, timeout_s=10)
            local = PeerInfo(EngineId("bench-reader"), Role.DECODE, memory.layout)
            hs = client.handshake(local)
            assert hs.peer.seal_layout is not None
            link = transport.connect("bench-owner", hs.peer.agent_metadata, hs.peer.layout, memory)
            seal_link = reader.connect("bench-owner", hs.peer.agent_metadata, hs.peer.seal_layout)
            leases = iter(enumerate(made))

            def read(ids: list[BlockId]) -> None:
                handle = transport.read_blocks(link, KVGroup.SELF, ids, ids, timeout_s=10)
                try:
                    handle.wait(10)
                finally:
                    handle.release()

            def sealed(n: int) -> None:
                _, (lease, ids) = next(leases)
                read(ids[:n])
                digest = seal_digest({KVGroup.SELF: ids}, {KVGroup.SELF: names})
                if not reader.holds(seal_link, lease, digest, 10):
                    raise RuntimeError(f"the seal of lease {lease} did not hold")
                reader.release(seal_link, lease)

            def verified(n: int) -> None:
                _, (lease, ids) = next(leases)
                read(ids[:n])
                digest = seal_digest({KVGroup.SELF: ids}, {KVGroup.SELF: names})
                want = {KVGroup.SELF: [digests[b] for b in ids[:n]]}
                # as a decode load does: digests while the seal READ is in flight, a thread of
                # the loader's pool hashing a share of the blocks
                expected = Expected(key, want, helper=helper if args.digest_helper else None)
                checked = []

                def check() -> None:
                    checked.append(expected.check(memory.layout, KVGroup.SELF, ids[:n]))

                if not reader.holds(seal_link, lease, digest, 10, check):
                    raise RuntimeError(f"the seal of lease {lease} did not hold")
                if checked[0].mismatches:
                    raise RuntimeError(f"the blocks of lease {lease} do not match their digests")
                reader.release(seal_link, lease)

            def owned(n: int) -> None:
                i, (lease, _) = next(leases)
                pinned = client.pin_request(RequestId(f"r{i}"), ttl_s=30)
                read(list(pinned.blocks[KVGroup.SELF][:n]))
                if not client.release(LeaseId(lease)):
                    raise RuntimeError(f"lease {lease} lapsed")

            for n in args.blocks:
                times: dict[str, list[float]] = {p: [] for p in protocols}
                steps: dict[str, Callable[[], None]] = {
                    "read": lambda n=n: read([BlockId(b) for b in range(n)]),  # type: ignore[misc]
                    "sealed": lambda n=n: sealed(n),  # type: ignore[misc]
                    "verified": lambda n=n: verified(n),  # type: ignore[misc]
                    "owner": lambda n=n: owned(n),  # type: ignore[misc]
                }
                for _ in range(per_size):
                    for protocol in protocols:  # interleaved: the machine's noise hits all
                        t0 = time.perf_counter()
                        steps[protocol]()
                        times[protocol].append((time.perf_counter() - t0) * 1e3)
                row: dict[str, Any] = {"blocks": n}
                for protocol in protocols:
                    ordered = sorted(times[protocol])
                    row[f"{protocol}_p50_ms"] = ordered[len(ordered) // 2]
                    row[f"{protocol}_p90_ms"] = ordered[int(len(ordered) * 0.9)]
                row["sealed_over_read_ms"] = row["sealed_p50_ms"] - row["read_p50_ms"]
                row["owner_over_read_ms"] = row["owner_p50_ms"] - row["read_p50_ms"]
                if args.verify:
                    row["verified_over_read"] = row["verified_p50_ms"] / row["read_p50_ms"]
                    row["verified_over_sealed_ms"] = row["verified_p50_ms"] - row["sealed_p50_ms"]
                rows.append(row)
            client.close()
            transport.disconnect(seal_link)
            transport.disconnect(link)
            reader.close()
    finally:
        stop.put(1)
        owner.join(30)
    print_table(rows, ["blocks", *(f"{p}_p50_ms" for p in protocols), "sealed_over_read_ms"])
    json_path, png_path = output_paths(args.out)
    payload = {"settings": settings_of(args), "machine": machine_info(), "rows": rows}
    print(f"wrote {write_json(json_path, payload)}")
    series = {p: [r[f"{p}_p50_ms"] for r in rows] for p in protocols}
    labels = [f"{r['blocks']} blocks" for r in rows]
    if bar_plot(png_path, "one decode load, p50", labels, series, "ms"):
        print(f"wrote {png_path}")
    return 0

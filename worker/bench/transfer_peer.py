"""The two processes of ``kvbridge bench transfer``: a target that owns KV memory, a reader.

Each runs :func:`serve` in a ``spawn``-ed process with its own environment
(``UCX_TLS=tcp`` must be set before the agent starts) and answers msgpack
requests over a pipe. The target only registers memory and drives NIXL's
progress; the reader connects, moves blocks and times it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import msgpack

from kvbridge.connector.transport.base import LocalMemory, PeerLink
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.presets import preset_layout
from kvbridge.worker.bench.report import percentile

__all__ = ["serve", "BenchPeer"]

log = logging.getLogger(__name__)

# the orders :meth:`BenchPeer.op_bare` takes its three moves in, one per repeat in turn
_ROTATIONS = (("ours", "bare", "raw"), ("bare", "raw", "ours"), ("raw", "ours", "bare"))


class BenchPeer:
    """One side of the benchmark; methods are the ops the driver may call."""

    def __init__(self, name: str, progress_interval_s: float) -> None:
        import torch

        from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport

        torch.set_num_threads(1)
        self.transport = NixlTransport(NixlConfig(name, progress_interval_s=progress_interval_s))
        self.memories: dict[str, tuple[LocalMemory, Mapping[str, Any]]] = {}
        self.links: dict[str, PeerLink] = {}

    def op_setup(
        self,
        key: str,
        preset: str,
        block_size: int,
        num_blocks: int,
        order: str,
        device: str = "cpu",
    ) -> dict[str, Any]:
        layout = preset_layout(preset, block_size=block_size, num_blocks=num_blocks, order=order)
        kv = layout.allocate(device)
        for layer in layout.owning_layers(KVGroup.SELF):
            kv[layer.name].fill_(1)  # touch every page so nothing reads the shared zero page
        memory = self.transport.register(layout, kv)
        self.memories[key] = (memory, kv)
        return {"layout": memory.layout.to_bytes(), "metadata": self.transport.metadata()}

    def op_connect(self, key: str, peer: str, metadata: bytes, layout: bytes) -> dict[str, Any]:
        remote = KVLayout.from_bytes(layout)
        old = self.links.pop(key, None)
        if old is not None:  # e.g. a link the peer's new metadata took down: linked again
            self.transport.disconnect(old)
        link = self.transport.connect(peer, metadata, remote, self.memories[key][0])
        self.links[key] = link
        return {"prep_s": link.prep_s, "descriptors_per_block": link.descriptors_per_block}

    def op_drop(self, key: str) -> dict[str, Any]:
        link = self.links.pop(key, None)
        if link is not None:
            self.transport.disconnect(link)
        memory, _ = self.memories.pop(key)
        self.transport.unregister(memory)
        return {}

    def _ids(self, key: str, n: int, pattern: str, rng: random.Random) -> tuple[list[int], ...]:
        link = self.links[key]
        local_n = link.local.layout.group(KVGroup.SELF).num_blocks
        remote_n = link.remote_layout.group(KVGroup.SELF).num_blocks
        if pattern == "sequential":
            return list(range(n)), list(range(n))
        return rng.sample(range(local_n), n), rng.sample(range(remote_n), n)

    def _move(self, key: str, op: str, local_ids: list[int], remote_ids: list[int]) -> float:
        fn = self.transport.read_blocks if op == "read" else self.transport.write_blocks
        t0 = time.perf_counter()
        handle = fn(self.links[key], KVGroup.SELF, local_ids, remote_ids, timeout_s=120.0)
        handle.wait()
        return time.perf_counter() - t0

    def op_bandwidth(
        self, key: str, op: str, pattern: str, n: int, repeats: int, seed: int
    ) -> dict[str, Any]:
        rng = random.Random(seed)
        nbytes = n * self.links[key].local.layout.block_bytes()
        times = []
        for i in range(repeats + 1):  # the first run warms the connection and the pages
            local_ids, remote_ids = self._ids(key, n, pattern, rng)
            elapsed = self._move(key, op, local_ids, remote_ids)
            if i:
                times.append(elapsed)
        times.sort()
        return {
            "gbps": nbytes / times[0] / 1e9,
            "median_gbps": nbytes / times[len(times) // 2] / 1e9,
            "descriptors": n * self.links[key].descriptors_per_block,
        }

    def op_bare(
        self, key: str, op: str, pattern: str, n: int, repeats: int, seed: int, raw_key: str
    ) -> dict[str, Any]:
        """The transport's transfer against bare NIXL moving the same bytes, interleaved.

        Each repeat moves one set of ids through ``read_blocks``/``write_blocks``,
        the same blocks with ``make_prepped_xfer`` + ``transfer`` +
        ``check_xfer_state`` on the link's own prepped lists, with descriptor
        indices computed before the clock starts (one descriptor per block on a
        block-outermost link), as a program calling NIXL by hand would, then the
        same byte count as one region through the link ``raw_key`` (one block of
        that size), the three in a rotating order. Returns the best GB/s of each,
        and ``vs_bare`` / ``vs_raw``: the median over the repeats of the other's
        time over the transport's (1 = as fast), so that a busy machine slows
        both sides of each ratio alike.
        """
        from kvbridge.worker.bench.bare_nixl import bare_move

        link = self.links[key]
        rng = random.Random(seed)
        nbytes = n * link.local.layout.block_bytes()
        times: dict[str, list[float]] = {"ours": [], "bare": [], "raw": []}
        for i in range(repeats + 1):  # the first round warms all three
            local_ids, remote_ids = self._ids(key, n, pattern, rng)
            taken = {}
            for name in _ROTATIONS[i % 3]:  # none of the three always goes first
                if name == "ours":
                    taken[name] = self._move(key, op, local_ids, remote_ids)
                elif name == "bare":
                    taken[name] = bare_move(self.transport, link, op, local_ids, remote_ids)
                else:
                    taken[name] = self._move(raw_key, op, [0], [0])
            if i:
                for name, elapsed in taken.items():
                    times[name].append(elapsed)
        ours, bare, raw = times["ours"], times["bare"], times["raw"]

        def median_ratio(other: list[float]) -> float:
            ratios = sorted(b / o for o, b in zip(ours, other, strict=True))
            return ratios[len(ratios) // 2]

        return {
            "gbps": nbytes / min(ours) / 1e9,
            "bare_gbps": nbytes / min(bare) / 1e9,
            "raw_gbps": nbytes / min(raw) / 1e9,
            "vs_bare": median_ratio(bare),
            "vs_raw": median_ratio(raw),
        }

    def op_latency(self, key: str, n: int, repeats: int, seed: int) -> dict[str, Any]:
        rng = random.Random(seed)
        times = []
        for _ in range(repeats):
            local_ids, remote_ids = self._ids(key, n, "random", rng)
            times.append(self._move(key, "read", local_ids, remote_ids))
        return {"p50_ms": percentile(times, 50) * 1e3, "p99_ms": percentile(times, 99) * 1e3}

    def op_memcpy(
        self, nbytes: int, repeats: int, src: str = "cpu", dst: str = "cpu"
    ) -> dict[str, Any]:
        """GB/s of torch copying ``nbytes`` from ``src`` to ``dst`` (host memory pinned when
        the other side is a GPU); with a GPU involved, also a device-to-device copy."""
        out = {"gbps": copy_gbps(nbytes, repeats, src, dst)}
        if "cuda" in (src, dst):
            out["d2d_gbps"] = copy_gbps(nbytes, repeats, "cuda", "cuda")
        return out

    def close(self) -> None:
        self.transport.close()


def copy_gbps(nbytes: int, repeats: int, src: str, dst: str) -> float:
    """Best GB/s of ``dst.copy_(src)`` over ``repeats`` runs after a warm-up (bytes moved
    once: a device-to-device copy reads and writes each byte, counted once as for READs)."""
    import torch

    pin = "cuda" in (src, dst)
    a = torch.ones(nbytes, dtype=torch.uint8, device=src, pin_memory=pin and src == "cpu")
    b = torch.zeros(nbytes, dtype=torch.uint8, device=dst, pin_memory=pin and dst == "cpu")

    def sync() -> None:
        if pin:
            torch.cuda.synchronize()

    b.copy_(a)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=pin)
        sync()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def serve(
    name: str,
    conn: Connection,
    env: Mapping[str, str],
    progress_interval_s: float,
) -> None:
    """Process entry point: set the environment, then answer requests until ``stop``."""
    os.environ.update(env)  # before the agent exists: UCX reads UCX_TLS when it starts
    logging.basicConfig(level=logging.WARNING)
    peer = BenchPeer(name, progress_interval_s)
    conn.send_bytes(msgpack.packb({"ok": True}))
    try:
        while True:
            try:
                req = msgpack.unpackb(conn.recv_bytes(), raw=False)
            except EOFError:  # the driver went away: clean up and exit
                break
            rpc = req.pop("rpc")
            if rpc == "stop":
                break
            try:
                reply = {"ok": True, **getattr(peer, f"op_{rpc}")(**req)}
            except Exception as exc:
                log.exception("bench request %s failed", rpc)
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
    finally:
        peer.close()
        with contextlib.suppress(OSError):
            conn.send_bytes(msgpack.packb({"ok": True}))

"""A NIXL transport in its own process, driven by the test over stdin/stdout.

Run as ``python -m tests.harness.transport_peer NAME [nixl]`` from the repository
root; it speaks ``tests.harness.frames``. Logs go to stderr, which the test keeps so it
can check for UCX leak warnings. Tensors are filled with seeded random data per
logical layer so any two processes agree on what a block should hold.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any

import torch

from kvbridge.connector.transport import LocalMemory, PeerLink, Transport
from kvbridge.proto import KVLayout, preset_layout
from tests.harness.frames import serve_ops


def fill(layout: KVLayout, kv: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for g in layout.groups:
        for layer in layout.owning_layers(g.name):
            t = kv[layer.name]
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def block_bytes(layout: KVLayout, kv: dict[str, torch.Tensor], group: str, b: int) -> bytes:
    """Logical content of block ``b``: every owning layer's K and V, in layer order."""
    parts = [kv[x.name][:, b].contiguous().view(torch.uint8) for x in layout.owning_layers(group)]
    return torch.cat([p.reshape(-1) for p in parts]).cpu().numpy().tobytes()


def make_transport(name: str, backend: str) -> Transport:
    if backend != "nixl":
        raise ValueError(f"unknown transport backend {backend!r} (this harness runs nixl)")
    from kvbridge.connector.transport import NixlConfig, NixlTransport

    # the test sets KVBRIDGE_NIXL_STRIDED=0 to get the dense Nx3 descriptor lists
    strided = os.environ.get("KVBRIDGE_NIXL_STRIDED", "1") != "0"
    return NixlTransport(NixlConfig(name, progress_interval_s=0.002, strided_descriptors=strided))


class Peer:
    def __init__(self, name: str, backend: str = "nixl") -> None:
        self.backend = backend
        self.transport: Any = make_transport(name, backend)
        self.memories: list[tuple[LocalMemory, dict[str, torch.Tensor]]] = []
        self.links: list[PeerLink] = []
        self.handles: list[Any] = []

    def op_setup(
        self, preset: str, num_blocks: int, order: str, seed: int, device: str = "cpu"
    ) -> dict[str, Any]:
        layout = preset_layout(preset, num_blocks=num_blocks, order=order)
        return self._setup(layout, seed, device)

    def op_setup_layout(self, layout: bytes, seed: int, device: str = "cpu") -> dict[str, Any]:
        """:meth:`op_setup` for a layout given in its wire form (e.g. one whose groups have
        pages of their own shape)."""
        return self._setup(KVLayout.from_bytes(layout), seed, device)

    def _setup(self, layout: KVLayout, seed: int, device: str) -> dict[str, Any]:
        from kvbridge.connector.transport.nixl_descs import mem_type

        kv = layout.allocate(device)
        fill(layout, kv, seed)
        memory = self.transport.register(layout, kv)
        self.memories.append((memory, kv))
        return {
            "mem": len(self.memories) - 1,
            "device": memory.device,
            "mem_type": mem_type(memory.device),
            "layout": memory.layout.to_bytes(),
            "metadata": self.transport.metadata(),
            "regions": self.transport.registered_regions(memory),
        }

    def op_metadata(self) -> dict[str, Any]:
        return {"metadata": self.transport.metadata()}

    def op_connect(self, peer: str, metadata: bytes, layout: bytes, mem: int) -> dict[str, Any]:
        remote = KVLayout.from_bytes(layout)
        link = self.transport.connect(peer, metadata, remote, self.memories[mem][0])
        self.links.append(link)
        return {
            "link": len(self.links) - 1,
            "mode": link.mode.value,
            "descriptors_per_block": link.descriptors_per_block,
        }

    def op_transfer(
        self,
        kind: str,
        link: int,
        local_ids: list[int],
        remote_ids: list[int],
        timeout_s: float,
        notify: bytes | None = None,
        group: str = "self",
    ) -> dict[str, Any]:
        fn = self.transport.read_blocks if kind == "read" else self.transport.write_blocks
        t0 = time.monotonic()
        handle = fn(
            self.links[link], group, local_ids, remote_ids, notify=notify, timeout_s=timeout_s
        )
        try:
            handle.wait()
        finally:
            handle.release()
        return {
            "elapsed": time.monotonic() - t0,
            "nbytes": handle.nbytes,
            "descriptors": handle.num_descriptors,
            "wire_descriptors": handle.wire_descriptors,
            "backend_s": handle.backend_seconds,
        }

    def op_blocks(self, mem: int, ids: list[int], group: str = "self") -> dict[str, Any]:
        memory, kv = self.memories[mem]
        return {"blocks": [block_bytes(memory.layout, kv, group, b) for b in ids]}

    def op_digests(
        self, mem: int, ids: list[int], key: int, algo: str | None = None, group: str = "self"
    ) -> dict[str, Any]:
        """Block digests of a memory: on the device for CUDA memory (kvbridge.kernels)."""
        from kvbridge.kernels import block_digests, digest_algo

        layout = self.memories[mem][0].layout
        if layout.regions[0].device.startswith("cuda"):
            torch.cuda.synchronize()
        return {
            "algo": algo or digest_algo(layout, group),
            "digests": block_digests(layout, group, ids, key, algo=algo),
        }

    def op_poke(self, mem: int, group: str, block_id: int, offset: int) -> dict[str, Any]:
        """Flip one byte at ``offset`` of block ``block_id``'s spans (in span order)."""
        layout = self.memories[mem][0].layout
        for span in layout.block_spans(group, block_id):
            if offset < span.length:
                addr = layout.regions[span.region].addr + span.offset + offset
                byte = ctypes.c_uint8.from_address(addr)
                byte.value ^= 0xFF
                return {}
            offset -= span.length
        raise ValueError(f"offset past block {block_id} of {group!r}")

    def op_notify(self, link: int, message: bytes) -> dict[str, Any]:
        self.transport.send_notification(self.links[link], message)
        return {}

    def op_notifications(self, wait_s: float = 0.0) -> dict[str, Any]:
        end = time.monotonic() + wait_s
        got: dict[str, list[bytes]] = {}
        while True:
            for k, v in self.transport.poll_notifications().items():
                got.setdefault(k, []).extend(v)
            if got or time.monotonic() >= end:
                return {"notifications": got}
            time.sleep(0.01)

    def op_disconnect(self, link: int) -> dict[str, Any]:
        self.transport.disconnect(self.links[link])
        return {}

    def op_state(self) -> dict[str, Any]:
        t = self.transport
        return {
            "pending": sum(len(s.handles) for s in t._links.values()),
            "leaked": len(t._leaked),
            "links_down": sum(1 for s in t._links.values() if s.down is not None),
            "dlists": sum(len(s.dlists) for s in t._links.values()),
            "peers": sorted(t._peers),
            "links": len(t._links),
            "memories": len(t._registrations),
        }

    def op_forge(
        self,
        peer: str,
        metadata: bytes,
        layout: bytes,
        block_id: int,
        payload: bytes,
        group: str = "self",
        claim: bytes | None = None,
    ) -> dict[str, Any]:
        """A token holder's attack: WRITE ``payload`` (repeated to fill the block) into block
        ``block_id`` of a remote memory described by ``layout`` (a KV cache or a seal table),
        with the agent metadata a handshake gave it. ``claim``: the layout of the memory it
        writes from (default ``layout``); one of another TP size writes a head slice of
        each of the block's pages (``HEAD_SLICE``). The link and the memory are gone
        again when it returns: one attacker process serves test after test."""
        remote = KVLayout.from_bytes(layout)
        mine = remote if claim is None else KVLayout.from_bytes(claim)
        kv = mine.allocate()
        memory = self.transport.register(mine, kv)
        try:
            bound = memory.layout
            spans = list(bound.block_spans(group, block_id))
            total = sum(s.length for s in spans)
            data = (payload * (total // len(payload) + 1))[:total]
            pos = 0
            for span in spans:
                region = bound.regions[span.region]
                ctypes.memmove(
                    region.addr + span.offset, data[pos : pos + span.length], span.length
                )
                pos += span.length
            link = self.transport.connect(peer, metadata, remote, memory)
            try:
                handle = self.transport.write_blocks(
                    link, group, [block_id], [block_id], timeout_s=10
                )
                try:
                    handle.wait()
                finally:
                    handle.release()
            finally:
                self.transport.disconnect(link)
        finally:
            self.transport.unregister(memory)
        return {"nbytes": total}

    def op_close(self) -> dict[str, Any]:
        state = self.op_state()
        self.transport.close()
        return state


def main() -> None:
    name = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "nixl"
    serve_ops(lambda: Peer(name, backend), name)


if __name__ == "__main__":
    main()

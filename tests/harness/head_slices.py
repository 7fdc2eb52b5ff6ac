"""Real NIXL READs of head slices between two agents in this process (``HEAD_SLICE``).

Run by ``tests/test_tp_ranks.py`` as ``python -m tests.harness.head_slices READER_TP``
(1 or 2; the owner has the other TP size). For each of the two rank pairs it
fills the owner's pages with seeded random floats, READs three blocks over a
``HEAD_SLICE`` link and compares every (layer, block) page byte for byte: a
TP=2 reader rank ``r`` must hold half ``r`` of the owner's page, a TP=1
reader's half ``r`` must hold owner rank ``r``'s page. Prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from kvbridge.connector.transport import NixlConfig, NixlTransport
from kvbridge.proto import KVLayout, preset_layout
from kvbridge.proto.negotiate import HEAD_MAJOR_SUFFIX, TransferMode

BLOCKS = 4


def packed(rank: int, size: int, order: str) -> KVLayout:
    """A vLLM-like packed head-major layout of the tiny model (2 KV heads)."""
    layout = preset_layout("tiny", num_blocks=BLOCKS, order=order)
    model = dataclasses.replace(layout.model, name=layout.model.name + HEAD_MAJOR_SUFFIX)
    return dataclasses.replace(layout, model=model, tp_rank=rank, tp_size=size)


def pages(layout: KVLayout, caches: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each (layer, block) page's bytes in memory order: ``[layer][block]``."""
    return [
        [caches[x.name][:, b].contiguous().view(torch.uint8).reshape(-1) for b in range(BLOCKS)]
        for x in layout.owning_layers("self")
    ]


def main() -> int:
    reader_tp = int(sys.argv[1])
    owner_tp = 3 - reader_tp  # 1 -> 2 and 2 -> 1
    owner = NixlTransport(NixlConfig("tp-owner", progress_interval_s=0.002))
    reader = NixlTransport(NixlConfig("tp-reader", progress_interval_s=0.002))
    remote_ids, local_ids = [3, 0, 2], [1, 2, 0]
    compared, mismatched = 0, []
    try:
        for rank in range(2):
            o_layout = packed(0 if owner_tp == 1 else rank, owner_tp, "layer-nhd")
            r_layout = packed(rank if reader_tp == 2 else 0, reader_tp, "block-nhd")
            o_caches = o_layout.allocate()
            gen = torch.Generator().manual_seed(rank)
            for t in o_caches.values():
                t.copy_(torch.randn(t.shape, generator=gen))
            r_caches = r_layout.allocate()
            o_mem = owner.register(o_layout, o_caches)
            r_mem = reader.register(r_layout, r_caches)
            link = reader.connect("tp-owner", owner.metadata(), o_mem.layout, r_mem)
            assert link.mode is TransferMode.HEAD_SLICE, link.mode
            assert link.descriptors_per_block == 4, link.descriptors_per_block
            handle = reader.read_blocks(link, "self", local_ids, remote_ids, timeout_s=30)
            handle.wait(30)
            assert handle.nbytes == 3 * min(o_layout.block_bytes(), r_layout.block_bytes())
            handle.release()
            o_pages, r_pages = pages(o_layout, o_caches), pages(r_layout, r_caches)
            for layer in range(4):
                for lb, rb in zip(local_ids, remote_ids, strict=True):
                    got, src = r_pages[layer][lb], o_pages[layer][rb]
                    if reader_tp == 2:  # my half of the owner's page
                        half = src.numel() // 2
                        ok = torch.equal(got, src[rank * half : (rank + 1) * half])
                    else:  # the owner rank's page is my half ``rank``
                        half = got.numel() // 2
                        ok = torch.equal(got[rank * half : (rank + 1) * half], src)
                    compared += 1
                    if not ok:
                        mismatched.append([rank, layer, lb])
            reader.disconnect(link)
            reader.unregister(r_mem)
            owner.unregister(o_mem)
    finally:
        reader.close()
        owner.close()
    print(json.dumps({"pages_compared": compared, "mismatched": mismatched}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

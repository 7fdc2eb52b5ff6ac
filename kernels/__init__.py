"""Block copies inside one process: copy, layout conversion, gather/scatter (CPU and CUDA).

Caches are ``{layer name: tensor}`` dicts as :meth:`KVLayout.allocate` builds
them (per-layer views of logical shape ``(2, num_blocks, block_size, H, C)``);
only owning layers are touched, KV-sharing layers are skipped. Each call
checks everything before moving a byte, then dispatches on device: torch
index ops on CPU (and between devices), one cupy span-kernel launch on a
CUDA device. Importing this package loads neither torch nor cupy; torch
loads on first use of a name below, cupy only when a CUDA tensor is passed.

- :func:`copy_blocks` — same layout, ``(src id, dst id)`` pairs;
- :func:`convert_blocks` — between two orders of the same model;
- :func:`gather_blocks` / :func:`scatter_blocks` — cache <-> contiguous staging
  buffer, block ``i`` at ``i * layout.block_bytes(group)`` (see
  :func:`gather_blocks` for the byte order inside a block);
- :class:`BlockMapping` — two id lists as one mapping;
- :func:`block_digests` — keyed digests of blocks, checked by a reader after a READ:
  XXH3-128 over CPU memory (:mod:`kvbridge.kernels.digest`), a multilinear hash computed
  on the device over CUDA memory (:mod:`kvbridge.kernels.digest_cuda`, with its CPU
  reference :func:`reference_block_digests`); :func:`page_slice_digests` — per head slice
  of each page, for readers of another TP size.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbridge.kernels.digest import (
        ALGO_DEVICE,
        ALGO_XXH3,
        DIGEST_BYTES,
        block_digests,
        digest_algo,
        head_digest_parts,
        keyed_block_digests,
        new_key,
        page_slice_digests,
        span_digest,
    )
    from kvbridge.kernels.digest_cuda import reference_block_digests, reference_digests
    from kvbridge.kernels.mapping import BlockMapping
    from kvbridge.kernels.ops import (
        convert_blocks,
        copy_blocks,
        gather_blocks,
        scatter_blocks,
        staging_nbytes,
    )

__all__ = [
    "ALGO_DEVICE",
    "ALGO_XXH3",
    "DIGEST_BYTES",
    "digest_algo",
    "head_digest_parts",
    "reference_block_digests",
    "reference_digests",
    "BlockMapping",
    "block_digests",
    "keyed_block_digests",
    "new_key",
    "page_slice_digests",
    "span_digest",
    "copy_blocks",
    "convert_blocks",
    "gather_blocks",
    "scatter_blocks",
    "staging_nbytes",
]

# ``import kvbridge.kernels`` stays light (no torch): the names load on first use.
_HOME = {
    "ALGO_DEVICE": "kvbridge.kernels.digest",
    "ALGO_XXH3": "kvbridge.kernels.digest",
    "DIGEST_BYTES": "kvbridge.kernels.digest",
    "digest_algo": "kvbridge.kernels.digest",
    "head_digest_parts": "kvbridge.kernels.digest",
    "reference_block_digests": "kvbridge.kernels.digest_cuda",
    "reference_digests": "kvbridge.kernels.digest_cuda",
    "block_digests": "kvbridge.kernels.digest",
    "keyed_block_digests": "kvbridge.kernels.digest",
    "new_key": "kvbridge.kernels.digest",
    "page_slice_digests": "kvbridge.kernels.digest",
    "span_digest": "kvbridge.kernels.digest",
    "BlockMapping": "kvbridge.kernels.mapping",
    "copy_blocks": "kvbridge.kernels.ops",
    "convert_blocks": "kvbridge.kernels.ops",
    "gather_blocks": "kvbridge.kernels.ops",
    "scatter_blocks": "kvbridge.kernels.ops",
    "staging_nbytes": "kvbridge.kernels.ops",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kvbridge.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted(__all__)

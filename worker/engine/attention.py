"""Paged attention over one layer's KV view, for one request at a time.

A layer's KV cache is the logical view ``(2, num_blocks, block_size, H, C)``
that :meth:`KVLayout.allocate` hands out; its strides follow the physical
order, but this module only ever indexes the logical dimensions, so it works
for every order. Token ``pos`` of a request lives in block
``block_table[pos // block_size]`` at slot ``pos % block_size``.

Determinism: the result for a chunk depends only on the chunk's tokens, its
start position and the KV bytes of positions ``< start``. Nothing here looks
at other requests, and gathered context is made contiguous before any
arithmetic, so the physical order never changes a single bit.
"""

from __future__ import annotations

import torch

__all__ = ["write_kv", "read_kv", "attend"]


def _slots(
    block_table: torch.Tensor, start: int, count: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + count, device=block_table.device)
    return block_table[pos // block_size], pos % block_size


def write_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store ``k``/``v`` (``T, H, C``) of positions ``start .. start+T-1`` in place."""
    blocks, offsets = _slots(block_table, start, k.shape[0], kv_cache.shape[2])
    kv_cache[0, blocks, offsets] = k
    kv_cache[1, blocks, offsets] = v


def read_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (``length, H, C``, contiguous) of positions ``0 .. length-1``."""
    block_size, heads, channels = kv_cache.shape[2:]
    n_blocks = -(-length // block_size)
    ids = block_table[:n_blocks]
    k = kv_cache[0, ids].reshape(n_blocks * block_size, heads, channels)[:length]
    v = kv_cache[1, ids].reshape(n_blocks * block_size, heads, channels)[:length]
    return k.contiguous(), v.contiguous()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    *,
    causal: bool = True,
) -> torch.Tensor:
    """Causal grouped-query attention of ``q`` (``T, Hq, C``) at positions ``start..`` over
    the context ``k``/``v`` (``S, Hkv, C``, ``S = start + T``); returns ``T, Hq, C``.

    With ``causal=False`` every query sees the whole context (``start`` is ignored): the
    encoder's self-attention and the decoder's cross-attention. Scores and softmax run in
    float32 whatever the KV dtype.
    """
    num_tokens, num_heads, _ = q.shape
    context = k.shape[0]
    group = num_heads // k.shape[1]
    qh = q.float().transpose(0, 1)  # Hq T C
    kh = k.float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # Hq C S
    vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # Hq S C
    scores = torch.matmul(qh, kh) * scale  # Hq T S
    if not causal:
        return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(0, 1).to(q.dtype)
    query_pos = torch.arange(start, start + num_tokens, device=q.device).unsqueeze(1)
    future = torch.arange(context, device=q.device).unsqueeze(0) > query_pos  # T S
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)  # Hq T C
    return out.transpose(0, 1).to(q.dtype)

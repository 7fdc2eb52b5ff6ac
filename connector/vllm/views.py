"""vLLM's per-layer KV tensors as kvbridge's logical views ``(2, B, N, H, C)``.

Imports torch only (no vLLM), so it is tested in kvbridge's own environment.
:func:`KVLayout.from_tensors <kvbridge.proto.layout.KVLayout.from_tensors>`
then infers the physical order from the views' strides and the layers' data
pointers. What vLLM 0.32 hands ``register_kv_caches``:

- **Packed** views ``(B, H, N, 2C)`` (every attention backend's page in 0.32,
  the CPU backend's K and V inside it): views into one buffer whose strides
  follow the resolved :class:`vllm.v1.kv_cache_layout.KVCacheLayout`. A
  block's ``H N 2C`` (``LBHNC``, ``BLHNC``) or ``N H 2C`` (``LBNHC``,
  ``BLNHC``) interior must be one dense span; it is described as two halves
  of that span. Whole blocks then move byte for byte, but the halves are not
  K and V, so the caller tags the model name with :func:`packed_suffix`:
  such a layout negotiates ``INCOMPATIBLE`` with any other interior instead
  of ``REARRANGE``-ing bytes that are not what they claim to be. ``BHLNC``
  and ``LHBNC`` (a block's heads apart) are rejected.
- **Split** views ``(2, B, N, H, C)`` (FlashAttention) or ``(B, 2, N, H, C)``
  (FlashInfer): real K and V, any strides; ``from_tensors`` checks they are
  dense in some order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvbridge.proto.errors import LayoutError

__all__ = ["PACKED_SUFFIX", "PageOf", "logical_views", "packed_suffix"]

PageOf = tuple[int, int, int]
"""A layer's page shape as vLLM's KV cache spec gives it: ``(KV heads of this rank, head
size, block size in tokens)``."""

PACKED_SUFFIX = "|vllm-packed-kv"
"""Appended to the layout's model name when K and V are packed in vLLM's head-major
(``H N 2C``) page: the logical views then name byte ranges, not real K/V."""


def packed_suffix(interior: str) -> str:
    """Model-name suffix of a packed page interior (``HNC`` keeps the historic suffix)."""
    return PACKED_SUFFIX if interior == "HNC" else f"{PACKED_SUFFIX}-{interior.lower()}"


def logical_views(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    pages: Mapping[str, PageOf] | None = None,
) -> tuple[dict[str, torch.Tensor], str | None]:
    """vLLM's per-layer KV tensors as views of logical shape ``(2, B, N, H, C)``.

    Each layer has ``num_kv_heads`` heads of ``head_size`` in blocks of ``block_size``
    tokens, unless ``pages`` gives the layer its own (its KV cache group's spec: vLLM's
    hybrid groups of Gemma-4 differ in head size and block size, at equal page bytes).

    Returns the views and, for packed K|V, the page interior (``"HNC"`` or
    ``"NHC"``; None for split K/V). Views are built from the tensors' real
    strides (``as_strided``/``permute``), never assuming contiguity. Layers
    that alias one tensor give views that alias too. Raises LayoutError naming
    the layer, shape and strides for anything else.
    """
    out: dict[str, torch.Tensor] = {}
    interiors: set[str] = set()
    default = (num_kv_heads, head_size, block_size)
    for name, t in kv_caches.items():
        heads, size, tokens = (pages or {}).get(name, default)
        split = (tokens, heads, size)
        packed = (heads, tokens, 2 * size)
        if t.dim() == 5 and t.shape[0] == 2 and tuple(t.shape[2:]) == split:
            out[name] = t  # FlashAttention: (2, B, N, H, C)
        elif t.dim() == 5 and t.shape[1] == 2 and tuple(t.shape[2:]) == split:
            out[name] = t.permute(1, 0, 2, 3, 4)  # FlashInfer: (B, 2, N, H, C)
        elif t.dim() == 4 and tuple(t.shape[1:]) == packed and (kind := _interior(t)):
            interiors.add(kind)
            out[name] = _halves(t, tokens, heads, size)
        else:
            raise LayoutError(
                f"layer {name!r}: vLLM KV tensor of shape {tuple(t.shape)} and strides "
                f"{t.stride()} is not a layout kvbridge knows (block_size {tokens}, "
                f"{heads} KV heads of {size}): it takes (B, H, N, 2*C) pages whose "
                "H N 2C or N H 2C interior is dense (vLLM layouts LBHNC, BLHNC, LBNHC, BLNHC), "
                "(2, B, N, H, C) or (B, 2, N, H, C)"
            )
    if interiors and (len(interiors) > 1 or any(t.dim() == 5 for t in kv_caches.values())):
        raise LayoutError(
            f"layers mix page interiors {sorted(interiors)} or packed pages and split K/V"
        )
    return out, (interiors.pop() if interiors else None)


def _interior(t: torch.Tensor) -> str | None:
    """``HNC`` or ``NHC`` when a ``(B, H, N, 2C)`` view's block interior is one dense span
    (content innermost, no padding) and blocks do not overlap; else None."""
    _, h, n, c2 = t.shape
    sb, sh, sn, sc = t.stride()
    if sc != 1 or sb < h * n * c2:
        return None
    if sn == c2 and (h == 1 or sh == n * c2):
        return "HNC"
    if sh == c2 and sn == h * c2:
        return "NHC"
    return None


def _halves(t: torch.Tensor, block_size: int, heads: int, head_size: int) -> torch.Tensor:
    """A dense ``H N 2C`` (or ``N H 2C``) block as ``(2, B, N, H, C)``: two halves of the
    block's span, each read as ``N H C``, at the tensor's own block stride."""
    span = block_size * heads * head_size
    v = torch.as_strided(
        t,
        (t.shape[0], 2, block_size, heads, head_size),
        (t.stride(0), span, heads * head_size, head_size, 1),
        t.storage_offset(),
    )
    return v.permute(1, 0, 2, 3, 4)

"""A Llama-style decoder in plain torch with deterministic seeded weights.

Embedding, then per layer RMSNorm -> GQA attention with RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual, then a final RMSNorm and the LM head. The
weights come from one ``torch.Generator`` seeded with ``config.seed`` in a
fixed order, drawn in float32 and cast, so every process with the same config
holds the same bits. Their scale is realistic (std ``1/sqrt(fan_in)``), so the
output really depends on the context.

A KV-sharing layer (``config.share_last`` / ``share_every``) has no K/V
projection: it computes its own queries and attends over its source layer's
KV, which it finds in its own (aliased) cache tensor, and writes nothing.

The model runs one request's chunk at a time (see :mod:`.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbridge.connector.base import WorkerConnector
from kvbridge.proto.tensors import torch_dtype
from kvbridge.worker.engine.attention import attend, read_kv, write_kv
from kvbridge.worker.engine.config import EngineConfig

__all__ = ["DecoderModel"]

_EPS = 1e-6


@dataclass(slots=True)
class _Layer:
    name: str
    shares_kv: bool
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor | None
    wv: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class DecoderModel:
    """Weights and the forward pass; owns no KV memory (the engine passes the views in)."""

    def __init__(self, config: EngineConfig, device: str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype)
        gen = torch.Generator().manual_seed(config.seed)
        d = config.hidden_size
        hc = config.num_heads * config.head_size
        kvc = config.num_kv_heads * config.head_size

        def linear(out_features: int, in_features: int) -> torch.Tensor:
            w = torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
            return w.to(device=self.device, dtype=self.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=self.dtype, device=self.device)

        self.embed = torch.randn(config.vocab_size, d, generator=gen).to(self.device, self.dtype)
        self.layers: list[_Layer] = []
        sources = config.kv_sources()
        for spec, source in zip(config.layout().layers, sources, strict=True):
            shares = source is not None
            self.layers.append(
                _Layer(
                    name=spec.name,
                    shares_kv=shares,
                    attn_norm=ones(d),
                    wq=linear(hc, d),
                    wk=None if shares else linear(kvc, d),
                    wv=None if shares else linear(kvc, d),
                    wo=linear(d, hc),
                    mlp_norm=ones(d),
                    w_gate=linear(config.intermediate_size, d),
                    w_up=linear(config.intermediate_size, d),
                    w_down=linear(d, config.intermediate_size),
                )
            )
        self.final_norm = ones(d)
        self.lm_head = linear(config.vocab_size, d)
        half = config.head_size // 2
        self._inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
        )

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        start: int,
        block_table: torch.Tensor,
        kv_caches: Mapping[str, torch.Tensor],
        connector: WorkerConnector | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions ``start ..`` of one request; return the last token's
        logits (float32, ``vocab_size``). Writes the tokens' K/V into ``kv_caches``
        through ``block_table`` (a long tensor of the request's block ids)."""
        cfg = self.config
        n = len(token_ids)
        x = self.embed[torch.tensor(token_ids, dtype=torch.long, device=self.device)]
        cos, sin = self._rope(start, n)
        scale = 1.0 / math.sqrt(cfg.head_size)
        for layer in self.layers:
            kv_cache = kv_caches[layer.name]
            if connector is not None:
                connector.wait_for_layer_load(layer.name)
            h = _rms_norm(x, layer.attn_norm)
            q = _rotate(_linear(h, layer.wq).view(n, cfg.num_heads, cfg.head_size), cos, sin)
            if layer.wk is not None and layer.wv is not None:
                k = _linear(h, layer.wk).view(n, cfg.num_kv_heads, cfg.head_size)
                v = _linear(h, layer.wv).view(n, cfg.num_kv_heads, cfg.head_size)
                write_kv(kv_cache, block_table, start, _rotate(k, cos, sin), v)
                if connector is not None:
                    connector.save_kv_layer(layer.name, kv_cache)
            k_ctx, v_ctx = read_kv(kv_cache, block_table, start + n)
            attn = attend(q, k_ctx, v_ctx, start, scale).reshape(n, -1)
            x = x + _linear(attn, layer.wo)
            h = _rms_norm(x, layer.mlp_norm)
            gate = torch.nn.functional.silu(_linear(h, layer.w_gate))
            x = x + _linear(gate * _linear(h, layer.w_up), layer.w_down)
        last = _rms_norm(x[-1:], self.final_norm)
        return _linear(last, self.lm_head)[0].float()

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, dtype=torch.float64)
        angles = torch.outer(pos, self._inv_freq).unsqueeze(1)  # T 1 C/2
        return angles.cos().float().to(self.device), angles.sin().float().to(self.device)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, weight.t())


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _EPS)
    return normed.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of ``x`` (``T, H, C``)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

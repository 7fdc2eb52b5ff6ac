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

**Prefill skip.** The layers after the last layer that owns KV (the *tail*,
all KV-sharing) write no KV, so nothing reads their hidden states except the
next tail layer and, for the last position, the LM head. With
``skip_tail`` a chunk that does not sample stops before the tail, and a chunk
that samples runs the tail on its last token only. The KV the owning layers
write is the same bytes either way, which is all that later chunks, decode
steps and P/D peers read.

**Encoder-decoder** (``config.encoder_decoder``). An encoder (byte
embeddings + sinusoidal positions, bidirectional layers) turns a request's
``encoder_input`` into one hidden state per byte. Each decoder layer projects
those into cross-attention K/V stored in the ``cross`` group through the
request's cross block table (written once, by :meth:`DecoderModel.write_cross_kv`)
and, after its self-attention, attends over all of them (no mask, no RoPE).
Encoder and cross weights are drawn after the decoder's, so a decoder-only
config keeps exactly the weights it had.

The model runs one request's chunk at a time (see :mod:`.attention`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbridge.connector.base import WorkerConnector
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.tensors import torch_dtype
from kvbridge.worker.engine.attention import attend, read_kv, write_kv
from kvbridge.worker.engine.config import EngineConfig

__all__ = ["CrossKV", "DecoderModel"]

_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class CrossKV:
    """Where one request's cross-attention K/V are: its cross block table and length."""

    block_table: torch.Tensor
    length: int


@dataclass(slots=True)
class _Cross:
    name: str
    norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor


@dataclass(slots=True)
class _EncoderLayer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


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
    cross: _Cross | None = None


ENCODER_VOCAB = 256
"""The encoder reads its input one byte per position."""


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
        self_layers = [x for x in config.layout().layers if x.group == KVGroup.SELF]
        for spec, source in zip(self_layers, sources, strict=True):
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
        self.tail_start = config.tail_start
        """First layer of the trailing KV-sharing run (``num_layers`` if there is none)."""
        self.encoder_embed: torch.Tensor | None = None
        self.encoder_layers: list[_EncoderLayer] = []
        self.encoder_norm = ones(d)
        if config.encoder_decoder:
            self.encoder_embed = torch.randn(ENCODER_VOCAB, d, generator=gen).to(
                self.device, self.dtype
            )
            for _ in range(config.encoder_layers):
                self.encoder_layers.append(
                    _EncoderLayer(
                        attn_norm=ones(d),
                        wq=linear(hc, d),
                        wk=linear(kvc, d),
                        wv=linear(kvc, d),
                        wo=linear(d, hc),
                        mlp_norm=ones(d),
                        w_gate=linear(config.intermediate_size, d),
                        w_up=linear(config.intermediate_size, d),
                        w_down=linear(d, config.intermediate_size),
                    )
                )
            for i, layer in enumerate(self.layers):
                layer.cross = _Cross(
                    name=f"layers.{i}.cross_attn",
                    norm=ones(d),
                    wq=linear(hc, d),
                    wk=linear(kvc, d),
                    wv=linear(kvc, d),
                    wo=linear(d, hc),
                )
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
        *,
        cross: CrossKV | None = None,
        skip_tail: bool = False,
        sample: bool = True,
    ) -> torch.Tensor | None:
        """Run tokens at positions ``start ..`` of one request; return the last token's
        logits (float32, ``vocab_size``). Writes the tokens' K/V into ``kv_caches``
        through ``block_table`` (a long tensor of the request's block ids).

        ``cross`` is required for an encoder-decoder model. With ``skip_tail`` the
        trailing KV-sharing layers run on the last token only, and not at all when
        ``sample`` is False (the result is then None).
        """
        n = len(token_ids)
        x = self.embed_tokens(token_ids)
        x = self.run_layers(x, start, 0, self.tail_start, block_table, kv_caches, connector, cross)
        if skip_tail and self.tail_start < len(self.layers):
            if not sample:
                return None
            x, start = x[-1:], start + n - 1
        x = self.run_layers(
            x, start, self.tail_start, len(self.layers), block_table, kv_caches, connector, cross
        )
        return self.logits(x)

    def embed_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Hidden states (``T, hidden_size``) of the tokens' embeddings."""
        return self.embed[torch.tensor(token_ids, dtype=torch.long, device=self.device)]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the last row of ``x`` after the final norm."""
        last = _rms_norm(x[-1:], self.final_norm)
        return _linear(last, self.lm_head)[0].float()

    @torch.inference_mode()
    def run_layers(
        self,
        x: torch.Tensor,
        start: int,
        first: int,
        stop: int,
        block_table: torch.Tensor,
        kv_caches: Mapping[str, torch.Tensor],
        connector: WorkerConnector | None = None,
        cross: CrossKV | None = None,
    ) -> torch.Tensor:
        """Decoder layers ``first .. stop-1`` over hidden states ``x`` of positions ``start ..``."""
        cfg = self.config
        n = x.shape[0]
        if first >= stop:
            return x
        cos, sin = self._rope(start, n)
        scale = 1.0 / math.sqrt(cfg.head_size)
        for layer in self.layers[first:stop]:
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
            if layer.cross is not None:
                if cross is None:
                    raise ConfigError("an encoder-decoder model needs the request's cross KV")
                x = x + self._cross_attend(layer.cross, x, kv_caches, cross, scale, connector)
            h = _rms_norm(x, layer.mlp_norm)
            gate = torch.nn.functional.silu(_linear(h, layer.w_gate))
            x = x + _linear(gate * _linear(h, layer.w_up), layer.w_down)
        return x

    def _cross_attend(
        self,
        c: _Cross,
        x: torch.Tensor,
        kv_caches: Mapping[str, torch.Tensor],
        cross: CrossKV,
        scale: float,
        connector: WorkerConnector | None,
    ) -> torch.Tensor:
        cfg = self.config
        if connector is not None:
            connector.wait_for_layer_load(c.name)
        q = _linear(_rms_norm(x, c.norm), c.wq).view(x.shape[0], cfg.num_heads, cfg.head_size)
        k_ctx, v_ctx = read_kv(kv_caches[c.name], cross.block_table, cross.length)
        attn = attend(q, k_ctx, v_ctx, 0, scale, causal=False).reshape(x.shape[0], -1)
        return _linear(attn, c.wo)

    # ------------------------------------------------------------------ encoder

    @torch.inference_mode()
    def encode(self, encoder_input: bytes) -> torch.Tensor:
        """The encoder's output (``len(encoder_input), hidden_size``), one row per byte."""
        if self.encoder_embed is None:
            raise ConfigError("this model has no encoder (EngineConfig.encoder_decoder is off)")
        if not encoder_input:
            raise ConfigError("encoder_input must not be empty")
        cfg = self.config
        ids = torch.frombuffer(bytearray(encoder_input), dtype=torch.uint8).long()
        x = self.encoder_embed[ids.to(self.device)] + _positions(
            len(encoder_input), cfg.hidden_size
        ).to(self.device, self.dtype)
        n = x.shape[0]
        scale = 1.0 / math.sqrt(cfg.head_size)
        for layer in self.encoder_layers:
            h = _rms_norm(x, layer.attn_norm)
            q = _linear(h, layer.wq).view(n, cfg.num_heads, cfg.head_size)
            k = _linear(h, layer.wk).view(n, cfg.num_kv_heads, cfg.head_size)
            v = _linear(h, layer.wv).view(n, cfg.num_kv_heads, cfg.head_size)
            attn = attend(q, k, v, 0, scale, causal=False).reshape(n, -1)
            x = x + _linear(attn, layer.wo)
            h = _rms_norm(x, layer.mlp_norm)
            gate = torch.nn.functional.silu(_linear(h, layer.w_gate))
            x = x + _linear(gate * _linear(h, layer.w_up), layer.w_down)
        return _rms_norm(x, self.encoder_norm)

    @torch.inference_mode()
    def write_cross_kv(
        self, encoded: torch.Tensor, cross: CrossKV, kv_caches: Mapping[str, torch.Tensor]
    ) -> None:
        """Project the encoder output into every decoder layer's cross K/V (written once)."""
        cfg = self.config
        n = encoded.shape[0]
        assert n == cross.length, (n, cross.length)
        for layer in self.layers:
            assert layer.cross is not None
            k = _linear(encoded, layer.cross.wk).view(n, cfg.num_kv_heads, cfg.head_size)
            v = _linear(encoded, layer.cross.wv).view(n, cfg.num_kv_heads, cfg.head_size)
            write_kv(kv_caches[layer.cross.name], cross.block_table, 0, k, v)

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, dtype=torch.float64)
        angles = torch.outer(pos, self._inv_freq).unsqueeze(1)  # T 1 C/2
        return angles.cos().float().to(self.device), angles.sin().float().to(self.device)


def _positions(n: int, d: int) -> torch.Tensor:
    """Sinusoidal absolute positions (``n, d``, float32), computed in float64."""
    pos = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    out = torch.zeros(n, d, dtype=torch.float64)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)
    return out.float()


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

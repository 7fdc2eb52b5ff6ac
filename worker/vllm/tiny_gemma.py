"""A tiny Gemma-3-style hybrid model with seeded random weights, for vLLM on a CPU.

One sliding-window layer (window 32 tokens: one 32-token block) and one full-attention
layer (``layer_types``): vLLM's hybrid KV cache manager makes two KV cache groups of one
layer each, sharing one KV cache tensor. Weights are drawn like
:mod:`kvbridge.worker.vllm.tiny_llama`'s; the embeddings are tied to the output, so the
post-norms scale the layers' outputs up and the attention is sharp
(``query_pre_attn_scalar`` 16): greedy output then depends on the first token of a
92-token prompt (without, it repeats the last prompt token). ``kvbridge bench vllm``
(its ``gemma3`` model) and the tests run it.

Run it in ``.venv-vllm``: ``python -m kvbridge.worker.vllm.tiny_gemma DIR``
(:func:`kvbridge.worker.vllm.write_hybrid_model` does). No tokenizer: start vLLM with
``skip_tokenizer_init=True`` and send token ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["GEMMA3", "write_gemma3"]

GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
"""One sliding-window layer (window 32 tokens: one 32-token block) and one full-attention
layer: vLLM's hybrid KV cache manager makes two KV cache groups of one layer each, sharing
one KV cache tensor."""


def write_gemma3(path: Path, seed: int = 0) -> None:
    """Write ``config.json`` and ``model.safetensors`` of :data:`GEMMA3` under ``path``."""
    import torch
    from safetensors.torch import save_file

    c = GEMMA3
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # Gemma's RMSNorm scales by (1 + weight): zeros are the identity
    w = {
        "model.embed_tokens.weight": rand(c["vocab_size"], hidden, std=0.1),
        "model.norm.weight": torch.zeros(hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "pre_feedforward_layernorm"):
            w[p + norm + ".weight"] = torch.zeros(hidden)
        # the post-norms scale attention and MLP outputs by 8 so that they, not the
        # token's own (tied) embedding, decide the next token
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            w[p + norm + ".weight"] = torch.full((hidden,), 7.0)
        w[p + "self_attn.q_norm.weight"] = torch.zeros(head)
        w[p + "self_attn.k_norm.weight"] = torch.zeros(head)
        w[p + "self_attn.q_proj.weight"] = rand(q_out, hidden, std=0.15)
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, hidden, std=0.15)
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, hidden, std=0.1)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, q_out, std=0.1)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden, std=0.1)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden, std=0.1)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter, std=0.1)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.path.mkdir(parents=True, exist_ok=True)
    if not (args.path / "config.json").exists():
        write_gemma3(args.path, args.seed)
    print(args.path)


if __name__ == "__main__":
    main()

"""A tiny Llama with seeded random weights, for running vLLM on a CPU in seconds.

Weights are drawn from a seeded normal distribution large enough that greedy
output depends on the whole context (vLLM's ``load_format="dummy"`` weights are
so small that the output ignores the prompt, which would hide wrong KV). No
tokenizer: start vLLM with ``skip_tokenizer_init=True`` and send token ids.

Run it to write the model: ``python -m kvbridge.worker.vllm.tiny_llama /tmp/tiny-llama``
(needs ``safetensors``; :func:`kvbridge.worker.vllm.write_model` runs it in ``.venv-vllm``).
``--layers``, ``--kv-heads``, ``--head-dim`` and ``--hidden`` change its shape (default:
4 layers, 2 KV heads of 64, hidden 256); e.g. ``--layers 8 --kv-heads 8 --head-dim 128
--hidden 512`` is the 8-layer model ``kvbridge bench vllm`` uses (2 MiB per 32-token block).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def shaped(
    layers: int = 4, kv_heads: int = 2, head_dim: int = 64, hidden: int = 256
) -> dict[str, Any]:
    """:data:`CONFIG` with another shape: query heads = KV heads (at least 4), MLP 2 x hidden."""
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"tiny Llama {name} must be >= 1, got {value}")
    if hidden < 8 or hidden % 2:
        raise ValueError(f"tiny Llama hidden must be an even number >= 8, got {hidden}")
    heads = kv_heads * max(1, 4 // kv_heads)
    return CONFIG | {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
    }


def write_model(path: Path, seed: int = 0, config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` under ``path`` (idempotent for one
    config: a directory holding another config is rewritten)."""
    import torch
    from safetensors.torch import save_file

    c = config or CONFIG
    path.mkdir(parents=True, exist_ok=True)
    done = (path / "model.safetensors").exists() and (path / "config.json").exists()
    if done and json.loads((path / "config.json").read_text()) == c:
        return path
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {
        "model.embed_tokens.weight": rand(c["vocab_size"], hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(c["vocab_size"], hidden, std=0.2),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rand(q_out, hidden, std=0.15)
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, hidden, std=0.15)
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, hidden, std=0.1)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, q_out, std=0.1)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden, std=0.1)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden, std=0.1)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter, std=0.1)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(c, indent=2))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    config = shaped(args.layers, args.kv_heads, args.head_dim, args.hidden)
    print(write_model(args.path, args.seed, config))


if __name__ == "__main__":
    main()

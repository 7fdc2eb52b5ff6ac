"""A tiny Llama with seeded random weights, for running vLLM on a CPU in seconds.

Weights are drawn from a seeded normal distribution large enough that greedy
output depends on the whole context (vLLM's ``load_format="dummy"`` weights are
so small that the output ignores the prompt, which would hide wrong KV). No
tokenizer: start vLLM with ``skip_tokenizer_init=True`` and send token ids.

Run it to write the model: ``python -m kvbridge.worker.vllm.tiny_llama /tmp/tiny-llama``
(needs ``safetensors``; :func:`kvbridge.worker.vllm.write_model` runs it in ``.venv-vllm``).
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


def write_model(path: Path, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` under ``path`` (idempotent)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if (path / "model.safetensors").exists() and (path / "config.json").exists():
        return path
    c = CONFIG
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
    args = parser.parse_args()
    print(write_model(args.path, args.seed))


if __name__ == "__main__":
    main()

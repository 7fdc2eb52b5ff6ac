"""Tiny models of other kinds than Llama, with seeded random weights, for vLLM on a CPU.

- ``gemma3``: a Gemma-3-style decoder with sliding-window and full-attention layers
  (:mod:`kvbridge.worker.vllm.tiny_gemma`, in the package: ``kvbridge bench vllm`` runs it).
- ``gemma4``: a Gemma-4-style decoder whose last layers share the KV of earlier ones
  (``num_kv_shared_layers``), made by ``transformers`` with its own random initialisation
  (greedy output still depends on the first token of a 92-token prompt).
- ``gemma4-wide``: ``gemma4`` with a larger head size (128) for the full-attention layers,
  as Gemma-4 has: vLLM gives the sliding group twice as long blocks (equal page bytes).
- ``gemma4-wide-kv2``: ``gemma4-wide`` with 2 KV heads, so that TP=2 splits them.
- ``gemma4-pad``: ``gemma4`` with a full-attention head size of 96, whose page the sliding
  group's does not divide: vLLM pads the sliding pages; only started (kvbridge refuses
  padded pages).
- ``gemma4-kv2``: ``gemma4`` with 2 KV heads, so that TP=2 splits them (one per rank)
  instead of replicating one.
- ``gemma4-full``: ``gemma4`` with full attention in every layer: a plain decoder whose
  last two layers share the first two's KV (one KV cache group, no sliding window).
- ``gemma4-full-kv2``: ``gemma4-full`` with 2 KV heads, so that TP=2 splits them.
- ``gemma4-deep``: a wider ``gemma4`` (hidden 512, 8 layers) whose last 6 layers share
  the first two's KV: the layers vLLM's prefill skip leaves out cost most of a prefill.
- ``mamba``: a one-layer Mamba (state-space, no attention), made by ``transformers``; it
  is only started (kvbridge refuses models with Mamba layers).
- ``whisper``: a Whisper-style encoder-decoder (one encoder and one decoder layer), made
  by ``transformers`` from its config with its own random initialisation, with a tokenizer
  of single characters (vLLM's Whisper processor needs one: start it with the tokenizer);
  it is only started, never asked for tokens (vLLM refuses KV connectors for
  encoder-decoder models).

Run it in ``.venv-vllm`` from the repository root:
``python -m tests.harness.tiny_models gemma3 DIR`` (:func:`tests.harness.vllm.write_tiny_model`
does). No tokenizer: start vLLM with
``skip_tokenizer_init=True`` and send token ids.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvbridge.worker.vllm.tiny_gemma import write_gemma3

WHISPER: dict[str, Any] = {
    "d_model": 64,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_mel_bins": 80,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "vocab_size": 1024,
    "decoder_start_token_id": 3,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _write_whisper(path: Path, seed: int) -> None:
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
    )

    torch.manual_seed(seed)
    WhisperForConditionalGeneration(WhisperConfig(**WHISPER)).save_pretrained(str(path))
    WhisperFeatureExtractor(feature_size=WHISPER["num_mel_bins"]).save_pretrained(str(path))
    # vLLM's Whisper processor needs a tokenizer: a byte-level BPE of single characters
    vocab = {"<|endoftext|>": 0, "<|startoftranscript|>": 1, "<|notimestamps|>": 2}
    for ch in "abcdefghijklmnopqrstuvwxyz ":
        vocab[ch] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    WhisperTokenizer(str(path / "vocab.json"), str(path / "merges.txt")).save_pretrained(str(path))


GEMMA4: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "global_head_dim": 64,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "num_kv_shared_layers": 2,
    "vocab_size_per_layer_input": 1024,
    "hidden_size_per_layer_input": 16,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}
"""Four layers (sliding, full, sliding, full); the last two share the KV of the first two
(``num_kv_shared_layers``). One head size everywhere (``global_head_dim`` 64): with
Gemma-4's larger global head size vLLM 0.32 fails at startup whenever its hybrid KV cache
manager is off (docs/VLLM.md, "KV-sharing layers")."""


def _write_gemma4(path: Path, seed: int, **overrides: Any) -> None:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    Gemma4ForCausalLM(Gemma4TextConfig(**{**GEMMA4, **overrides})).save_pretrained(str(path))


def _write_gemma4_kv2(path: Path, seed: int) -> None:
    _write_gemma4(path, seed, num_key_value_heads=2)


def _write_gemma4_full(path: Path, seed: int) -> None:
    _write_gemma4(path, seed, layer_types=["full_attention"] * 4)


def _write_gemma4_full_kv2(path: Path, seed: int) -> None:
    _write_gemma4(path, seed, layer_types=["full_attention"] * 4, num_key_value_heads=2)


def _write_gemma4_deep(path: Path, seed: int) -> None:
    _write_gemma4(
        path,
        seed,
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_hidden_layers=8,
        layer_types=["sliding_attention", "full_attention"] * 4,
        num_kv_shared_layers=6,
    )


def _write_gemma4_wide(path: Path, seed: int) -> None:
    """:func:`_write_gemma4` with Gemma-4's larger head size for the full-attention layers
    (``global_head_dim`` 128, 64 elsewhere): vLLM's KV cache groups then differ in page
    shape (the sliding group gets 64-token blocks)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    Gemma4ForCausalLM(Gemma4TextConfig(**{**GEMMA4, "global_head_dim": 128})).save_pretrained(
        str(path)
    )


def _write_gemma4_wide_kv2(path: Path, seed: int) -> None:
    _write_gemma4(path, seed, global_head_dim=128, num_key_value_heads=2)


def _write_gemma4_pad(path: Path, seed: int) -> None:
    """:func:`_write_gemma4` with a full-attention head size of 96: 24 KiB pages beside the
    sliding group's 16 KiB, which do not divide them, so vLLM pads the sliding pages
    (``page_size_padded``) instead of giving the group longer blocks."""
    _write_gemma4(path, seed, global_head_dim=96)


MAMBA: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "state_size": 8,
    "expand": 2,
    "conv_kernel": 4,
    "vocab_size": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _write_mamba(path: Path, seed: int) -> None:
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    MambaForCausalLM(MambaConfig(**MAMBA)).save_pretrained(str(path))


WRITERS = {
    "gemma3": write_gemma3,
    "gemma4": _write_gemma4,
    "gemma4-wide": _write_gemma4_wide,
    "gemma4-pad": _write_gemma4_pad,
    "gemma4-wide-kv2": _write_gemma4_wide_kv2,
    "gemma4-kv2": _write_gemma4_kv2,
    "gemma4-full": _write_gemma4_full,
    "gemma4-full-kv2": _write_gemma4_full_kv2,
    "gemma4-deep": _write_gemma4_deep,
    "mamba": _write_mamba,
    "whisper": _write_whisper,
}


def write_model(kind: str, path: Path, seed: int = 0) -> Path:
    """Write the ``kind`` model (:data:`WRITERS`) under ``path`` (skipped if there)."""
    if kind not in WRITERS:
        raise ValueError(f"unknown tiny model kind {kind!r}: one of {sorted(WRITERS)}")
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "config.json").exists():
        WRITERS[kind](path, seed)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(WRITERS))
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_model(args.kind, args.path, args.seed))


if __name__ == "__main__":
    main()

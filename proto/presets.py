"""The model names of every ``kvbridge`` command, and their KV layouts.

``PRESETS`` is the one list of model names: ``kvbridge layout --model``,
``serve``/``demo``/``offload serve``/``serve-control --model`` and the
benchmarks take these names (``--preset`` is an alias of ``--model``). The
reference engine (``serve``, ``demo``) runs the small ones that have weights
(``ENGINE_MODELS``); the others are layout shapes of real models.

Each preset is a function of block size, block count and order so that a
benchmark can sweep them. KV-sharing patterns follow recent models: the
trailing layers reading earlier layers' KV (``share_last``), or every m-th
layer reusing the previous layer's KV (``share_every``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvbridge.proto.errors import ConfigError
from kvbridge.proto.layout import GroupSpec, KVLayout, LayerSpec, ModelSpec, parse_order
from kvbridge.proto.specs import KVGroup

__all__ = ["ENGINE_MODELS", "PRESETS", "PresetShape", "make_layout", "preset_layout"]


@dataclass(frozen=True, slots=True)
class PresetShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    encoder_decoder: bool = False
    share_last: int = 0
    share_every: int = 0


PRESETS: Mapping[str, PresetShape] = {
    # Llama-3-8B: 32 layers x 8 KV heads x 128, bf16 -> 2 MiB per 16-token block
    "llama3-8b": PresetShape("llama3-8b", 32, 8, 128, "bfloat16"),
    # a small decoder for tests and the reference engine
    "tiny": PresetShape("tiny", 4, 2, 32, "float32"),
    "small": PresetShape("small", 8, 4, 64, "bfloat16"),
    # Whisper-small-like encoder-decoder: 12 decoder layers, self + cross attention
    "encdec-small": PresetShape("encdec-small", 12, 12, 64, "bfloat16", encoder_decoder=True),
    # last third of the layers reuse earlier layers' KV
    "kv-share-third": PresetShape("kv-share-third", 24, 8, 128, "bfloat16", share_last=8),
    # every second layer reuses the previous layer's KV
    "kv-share-every2": PresetShape("kv-share-every2", 24, 8, 128, "bfloat16", share_every=2),
    # "tiny" with cross-attention KV (the reference engine adds an encoder over bytes)
    "encdec-tiny": PresetShape("encdec-tiny", 4, 2, 32, "float32", encoder_decoder=True),
    # 8 layers, the last 4 reading the KV of layers 0-3: KV sharing and prefill skip
    "share-tiny": PresetShape("share-tiny", 8, 2, 32, "float32", share_last=4),
}
ENGINE_MODELS = ("tiny", "small", "encdec-tiny", "share-tiny")
"""The names the reference engine runs (``kvbridge serve``/``demo --model``)."""


def _kv_sources(num_layers: int, share_last: int, share_every: int) -> list[int | None]:
    if share_last and share_every:
        raise ConfigError(
            "choose one KV-sharing pattern: share_last or share_every (--share-last or "
            "--share-every)"
        )
    if not 0 <= share_last < num_layers or share_last * 2 > num_layers:
        raise ConfigError(
            f"share_last={share_last}: the model has {num_layers} layers, and at least as many "
            f"must own KV as share it: give 1 to {num_layers // 2}"
        )
    if share_every == 1 or share_every < 0:
        raise ConfigError(f"share_every={share_every} must be 0 (off) or >= 2")
    first_shared = num_layers - share_last
    sources: list[int | None] = []
    for i in range(num_layers):
        if share_last and i >= first_shared:
            sources.append(i - share_last)
        elif share_every and i % share_every == share_every - 1:
            sources.append(i - 1)
        else:
            sources.append(None)
    return sources


def make_layout(
    shape: PresetShape,
    *,
    block_size: int = 16,
    num_blocks: int = 64,
    num_cross_blocks: int | None = None,
    order: str | tuple[str, ...] = "block-nhd",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> KVLayout:
    """A layout for ``shape``; layer names follow vLLM (``layers.{i}.self_attn``)."""
    sources = _kv_sources(shape.num_layers, shape.share_last, shape.share_every)
    layers = [
        LayerSpec(
            f"layers.{i}.self_attn", KVGroup.SELF, None if s is None else f"layers.{s}.self_attn"
        )
        for i, s in enumerate(sources)
    ]
    groups = [GroupSpec(KVGroup.SELF, num_blocks)]
    if shape.encoder_decoder:
        layers += [
            LayerSpec(f"layers.{i}.cross_attn", KVGroup.CROSS) for i in range(shape.num_layers)
        ]
        groups.append(GroupSpec(KVGroup.CROSS, num_cross_blocks or num_blocks))
    model = ModelSpec(
        shape.name, shape.dtype, shape.num_layers, shape.num_kv_heads, shape.head_size
    )
    return KVLayout(
        model=model,
        block_size=block_size,
        groups=tuple(groups),
        layers=tuple(layers),
        order=parse_order(order),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def preset_layout(name: str, **kwargs: object) -> KVLayout:
    """``make_layout(PRESETS[name], **kwargs)`` with a helpful error for unknown names."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}")
    build: Callable[..., KVLayout] = make_layout
    return build(PRESETS[name], **kwargs)

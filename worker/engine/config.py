"""``EngineConfig``: the reference engine's model shape, seed and KV layout knobs.

One frozen value, built once at the edge (CLI flags, a test) and validated in
``__post_init__``. Two processes with equal configs build bit-identical
weights and identical :class:`~kvbridge.proto.layout.KVLayout`\\ s, so their
block hashes agree and their KV bytes are interchangeable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from kvbridge.proto.errors import ConfigError
from kvbridge.proto.layout import ORDERS, KVGroup, KVLayout
from kvbridge.proto.presets import PRESETS, PresetShape, make_layout

__all__ = ["EngineConfig", "ENGINE_PRESETS"]

DTYPES = ("float32", "bfloat16")

# Fields that change the weights or what the KV bytes mean (not the layout's memory facts).
_MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_size",
    "intermediate_size",
    "dtype",
    "seed",
    "rope_theta",
    "share_last",
    "share_every",
    "encoder_decoder",
    "encoder_layers",
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A Llama-style decoder plus the paged KV cache it runs on."""

    name: str = "tiny"
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    intermediate_size: int = 256
    dtype: str = "float32"
    seed: int = 0
    rope_theta: float = 10000.0
    block_size: int = 16
    num_blocks: int = 256
    order: str = "block-nhd"
    share_last: int = 0
    """The last ``share_last`` layers reuse the KV of the layer ``share_last`` before them."""
    share_every: int = 0
    """Every ``share_every``-th layer reuses the previous layer's KV (0: off)."""
    prefill_skip: bool = False
    """During prefill, the trailing run of KV-sharing layers (after the last layer that owns
    KV) computes only each request's last prompt token; outputs are unchanged."""
    encoder_decoder: bool = False
    """Add an encoder over the request's ``encoder_input`` bytes and per-layer cross-attention
    whose K/V live in the layout's ``cross`` group."""
    encoder_layers: int = 2
    """Bidirectional transformer layers of the encoder (encoder-decoder only)."""
    num_cross_blocks: int = 64
    """Blocks of the ``cross`` group (encoder-decoder only)."""
    max_encoder_len: int = 512
    """Longest encoder input in bytes (one encoder position per byte)."""

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_size",
            "intermediate_size",
            "block_size",
            "num_blocks",
            "encoder_layers",
            "num_cross_blocks",
            "max_encoder_len",
        )
        for knob in positive:
            value = getattr(self, knob)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EngineConfig.{knob} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"EngineConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_size % 2:
            raise ConfigError(f"EngineConfig.head_size={self.head_size} must be even for RoPE")
        if self.dtype not in DTYPES:
            raise ConfigError(f"EngineConfig.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.order not in ORDERS:
            raise ConfigError(f"EngineConfig.order={self.order!r} is not one of {list(ORDERS)}")
        if not self.rope_theta > 0:
            raise ConfigError(f"EngineConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"EngineConfig.seed must be an int >= 0, got {self.seed!r}")
        for flag in ("prefill_skip", "encoder_decoder"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    f"EngineConfig.{flag} must be a bool, got {getattr(self, flag)!r}"
                )
        if self.encoder_decoder and self.cross_blocks_needed(self.max_encoder_len) > (
            self.num_cross_blocks
        ):
            raise ConfigError(
                f"EngineConfig.num_cross_blocks={self.num_cross_blocks} cannot hold one encoder "
                f"input of max_encoder_len={self.max_encoder_len}; raise it"
            )
        try:
            self.layout()  # validates share_last / share_every against num_layers
        except ConfigError as exc:
            raise ConfigError(f"EngineConfig: {exc}") from None

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> EngineConfig:
        """A named preset (``tiny``, ``small``) with some fields replaced."""
        if name not in ENGINE_PRESETS:
            kind = "has no reference-engine weights" if name in PRESETS else "is unknown"
            raise ConfigError(
                f"model {name!r} {kind}; the reference engine runs "
                f"{', '.join(ENGINE_PRESETS)} (every model name works with kvbridge layout)"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"EngineConfig has no field(s) {unknown}")
        return replace(ENGINE_PRESETS[name], **overrides)

    @property
    def model_id(self) -> str:
        """The model's identity in the KV layout: preset name plus a digest of the weights'
        recipe, so engines with another seed or shape never share prefix-cache hashes."""
        recipe = {k: v for k, v in asdict(self).items() if k in _MODEL_FIELDS}
        digest = hashlib.sha256(repr(sorted(recipe.items())).encode()).hexdigest()[:12]
        return f"{self.name}-{digest}"

    def shape(self) -> PresetShape:
        return PresetShape(
            name=self.model_id,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            share_last=self.share_last,
            share_every=self.share_every,
            encoder_decoder=self.encoder_decoder,
        )

    def layout(self) -> KVLayout:
        """The KV layout of this engine (no regions: :meth:`KVLayout.bind` adds them)."""
        return make_layout(
            self.shape(),
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_cross_blocks=self.num_cross_blocks,
            order=self.order,
        )

    def kv_sources(self) -> list[int | None]:
        """Per layer: the index of the layer whose KV it reuses, or None if it owns KV."""
        layers = [x for x in self.layout().layers if x.group == KVGroup.SELF]
        index = {x.name: i for i, x in enumerate(layers)}
        return [None if x.kv_source is None else index[x.kv_source] for x in layers]

    @property
    def tail_start(self) -> int:
        """Index of the first layer of the trailing run of KV-sharing layers (the layers after
        the last one that owns KV); ``num_layers`` when the last layer owns KV."""
        sources = self.kv_sources()
        owners = [i for i, s in enumerate(sources) if s is None]
        return owners[-1] + 1

    def cross_blocks_needed(self, encoder_len: int) -> int:
        """Cross blocks of one request whose encoder input has ``encoder_len`` positions."""
        return -(-encoder_len // self.block_size)


def _from_preset(shape: PresetShape, **model: Any) -> EngineConfig:
    return EngineConfig(
        name=shape.name,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        dtype=shape.dtype,
        encoder_decoder=shape.encoder_decoder,
        share_last=shape.share_last,
        share_every=shape.share_every,
        **model,
    )


ENGINE_PRESETS: Mapping[str, EngineConfig] = MappingProxyType(
    {
        # 4 layers x 2 KV heads x 32, float32: fast enough for every test
        "tiny": _from_preset(
            PRESETS["tiny"], vocab_size=512, hidden_size=128, num_heads=4, intermediate_size=256
        ),
        # 8 layers x 4 KV heads x 64, bfloat16: for benchmarks and the demo
        "small": _from_preset(
            PRESETS["small"], vocab_size=2048, hidden_size=512, num_heads=8, intermediate_size=1024
        ),
        # "tiny" with an encoder over byte inputs and cross-attention KV in a "cross" group
        "encdec-tiny": _from_preset(
            PRESETS["encdec-tiny"],
            vocab_size=512,
            hidden_size=128,
            num_heads=4,
            intermediate_size=256,
        ),
        # 8 layers, the last 4 reading the KV of layers 0-3: for KV sharing and prefill skip
        "share-tiny": _from_preset(
            PRESETS["share-tiny"],
            vocab_size=512,
            hidden_size=128,
            num_heads=4,
            intermediate_size=256,
        ),
    }
)

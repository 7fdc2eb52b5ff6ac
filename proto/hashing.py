"""Prefix-hash identity of full blocks (docs/DESIGN-NOTES.md, "Block naming").

Block *i* of a request is named ``H(name_{i-1} || tokens_i)``, where the chain
starts at a *request root*: ``H(model root || extra keys)``. The model root is
``H("kvbridge-blocks-v1" || algorithm || seed || layout fingerprint)``, so
blocks of another model, another seed or another block size never match.
Extra keys (LoRA id, encoder/multimodal input hash, cache salt) go into the
request root, which every block inherits through the chain; the cache salt
therefore changes the first block and everything after it.

Tokens are packed as little-endian uint32, so names are identical in every
process and on every node (never Python's ``hash()``, never a per-process
seed). SHA-256 is the default: a crafted collision would let one tenant read
another's KV. ``xxh3_128`` is faster and fine inside one trust domain.

Cross-attention blocks are named ``H(model root || "cross" || encoder input
hash || index)``: they depend only on the encoder input, so two requests
with the same audio share them.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.proto import codec
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.types import BlockHash

__all__ = ["HASH_ALGORITHMS", "HashConfig", "ExtraKeys", "BlockHasher"]

HASH_ALGORITHMS = ("sha256", "xxh3_128")
_MAX_TOKEN = 2**32 - 1
assert array.array("I").itemsize == 4


def _hash_ctor(algorithm: str) -> Callable[[bytes], Any]:
    """A constructor whose result has ``.digest()``: hashlib/xxhash style."""
    if algorithm == "sha256":
        return hashlib.sha256
    if algorithm == "xxh3_128":
        import xxhash

        ctor: Callable[[bytes], Any] = xxhash.xxh3_128
        return ctor
    raise ConfigError(f"hash algorithm {algorithm!r} is not one of {', '.join(HASH_ALGORITHMS)}")


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How block names are made; every node of a deployment must use the same one."""

    algorithm: str = "sha256"
    seed: str = ""

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                f"hash_algorithm {self.algorithm!r} is not one of {', '.join(HASH_ALGORITHMS)}"
            )


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Request-level inputs besides tokens that change what the KV means."""

    lora_id: str | None = None
    encoder_hash: bytes | None = None
    cache_salt: str | None = None

    def is_empty(self) -> bool:
        return self.lora_id is None and self.encoder_hash is None and self.cache_salt is None


def _pack_tokens(tokens: Sequence[int] | np.ndarray, count: int) -> bytes:
    """The first ``count`` token ids as little-endian uint32 bytes."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ConfigError(f"tokens must be one-dimensional, got shape {tokens.shape}")
        head = tokens[:count]
        if head.size and (head.min() < 0 or head.max() > _MAX_TOKEN):
            raise ConfigError("token ids must be in 0..2**32-1")
        return head.astype("<u4", copy=False).tobytes()
    try:
        packed = array.array("I", tokens[:count])  # 4x faster than numpy for a list
    except (OverflowError, TypeError) as exc:
        raise ConfigError(f"token ids must be ints in 0..2**32-1 ({exc})") from None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Names full blocks. Stateless after construction; safe to share between threads."""

    def __init__(self, fingerprint: bytes, block_size: int, config: HashConfig | None = None):
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.config = config or HashConfig()
        self.block_size = block_size
        self._new = _hash_ctor(self.config.algorithm)
        self.root = BlockHash(
            self._digest(
                b"kvbridge-blocks-v1\0"
                + self.config.algorithm.encode()
                + b"\0"
                + self.config.seed.encode()
                + b"\0"
                + fingerprint
            )
        )

    def _digest(self, data: bytes) -> bytes:
        digest: bytes = self._new(data).digest()
        return digest

    def request_root(self, extra: ExtraKeys | None = None) -> BlockHash:
        """The parent of a request's first block."""
        if extra is None or extra.is_empty():
            return self.root
        keys = codec.pack(
            "ExtraKeys",
            {"lora": extra.lora_id, "enc": extra.encoder_hash, "salt": extra.cache_salt},
        )
        return BlockHash(self._digest(self.root + keys))

    def hash_blocks(
        self,
        tokens: Sequence[int] | np.ndarray,
        extra: ExtraKeys | None = None,
        *,
        parent: BlockHash | None = None,
    ) -> list[BlockHash]:
        """Names of every *full* block of ``tokens`` (a trailing partial block has none).

        Pass ``parent`` (the name of the block before ``tokens[0]``) to extend a
        chain incrementally; otherwise the chain starts at the request root.
        """
        n_full = len(tokens) // self.block_size
        data = _pack_tokens(tokens, n_full * self.block_size)
        step = self.block_size * 4
        new = self._new
        prev = parent if parent is not None else self.request_root(extra)
        out: list[BlockHash] = []
        append = out.append
        for start in range(0, n_full * step, step):
            prev = new(prev + data[start : start + step]).digest()
            append(prev)
        return out

    def cross_block_hashes(self, encoder_hash: bytes, num_blocks: int) -> list[BlockHash]:
        """Names of a request's cross-attention blocks, from its encoder input hash."""
        base = self.root + b"cross\0" + encoder_hash
        return [BlockHash(self._digest(base + i.to_bytes(4, "little"))) for i in range(num_blocks)]

    def encoder_input_hash(self, data: bytes) -> bytes:
        """Hash of raw encoder input (audio frames, pixels, token bytes)."""
        return self._digest(b"encoder-input\0" + data)

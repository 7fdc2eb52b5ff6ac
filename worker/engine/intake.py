"""A new request, checked and named before the scheduler queues it.

:func:`check_request` rejects what could never run (no prompt, no encoder input
where the model needs one, more blocks than the pool has) with a
:class:`~kvbridge.proto.errors.ConfigError` that names the knob;
:func:`name_request` names its full blocks by prefix hash (the encoder input's
hash is an extra key of every self block) and its cross blocks, if any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.proto.errors import ConfigError
from kvbridge.proto.hashing import BlockHasher, ExtraKeys
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import RequestId
from kvbridge.worker.block_pool import BlockPool
from kvbridge.worker.engine.block_tables import blocks_needed
from kvbridge.worker.engine.request import Request

__all__ = ["check_request", "name_request"]


def check_request(
    prompt: Sequence[int],
    max_tokens: int,
    encoder_input: bytes | None,
    pools: Mapping[KVGroup, BlockPool],
    block_size: int,
) -> None:
    """Raise :class:`ConfigError` for a request this engine could never run."""
    has_cross = KVGroup.CROSS in pools
    if has_cross != bool(encoder_input):
        raise ConfigError(
            "an encoder-decoder engine needs a non-empty encoder_input per request"
            if has_cross
            else "encoder_input given, but this engine has no encoder (encoder_decoder off)"
        )
    if not prompt:
        raise ConfigError("prompt_token_ids must not be empty")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    need = blocks_needed(len(prompt), max_tokens, block_size)
    if need > pools[KVGroup.SELF].num_blocks:
        raise ConfigError(
            f"a request of {len(prompt)} prompt tokens and max_tokens={max_tokens} needs "
            f"{need} blocks; raise num_blocks (now {pools[KVGroup.SELF].num_blocks})"
        )


def name_request(
    hasher: BlockHasher,
    pools: Mapping[KVGroup, BlockPool],
    rid: RequestId,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None,
    encoder_input: bytes | None,
) -> Request:
    """The :class:`Request` with its block hashes (and cross block hashes)."""
    encoder_hash = None
    cross_hashes: list[Any] = []
    if encoder_input:
        n_cross = -(-len(encoder_input) // hasher.block_size)
        if n_cross > pools[KVGroup.CROSS].num_blocks:
            raise ConfigError(
                f"an encoder input of {len(encoder_input)} positions needs {n_cross} cross "
                f"blocks; raise num_cross_blocks (now {pools[KVGroup.CROSS].num_blocks})"
            )
        encoder_hash = hasher.encoder_input_hash(encoder_input)
        cross_hashes = hasher.cross_block_hashes(encoder_hash, n_cross)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        block_hashes=hasher.hash_blocks(prompt, ExtraKeys(encoder_hash=encoder_hash)),
        kv_transfer_params=kv_transfer_params,
        encoder_input=encoder_input,
        encoder_hash=encoder_hash,
        cross_hashes=cross_hashes,
    )

"""Block hashing: deterministic across processes, chained, keyed by everything that matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.proto import BlockHasher, ConfigError, ExtraKeys, HashConfig, preset_layout

LAYOUT = preset_layout("tiny")


def hasher(**kwargs: str) -> BlockHasher:
    return BlockHasher(LAYOUT.fingerprint(), LAYOUT.block_size, HashConfig(**kwargs))


def test_only_full_blocks_are_named() -> None:
    h = hasher()
    assert len(h.hash_blocks(list(range(47)))) == 2
    assert len(h.hash_blocks(list(range(48)))) == 3
    assert h.hash_blocks([]) == []


@given(st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=200), st.integers(0, 12))
@settings(max_examples=100, deadline=None)
def test_chain_names_a_prefix_independently_of_what_follows(tokens: list[int], cut: int) -> None:
    h = hasher()
    full = h.hash_blocks(tokens)
    cut = min(cut, len(full))
    assert h.hash_blocks(tokens[: cut * 16]) == full[:cut]
    # extending from a parent gives the same chain as hashing from the start
    if cut:
        rest = h.hash_blocks(tokens[cut * 16 :], parent=full[cut - 1])
        assert full[:cut] + rest == full
    assert h.hash_blocks(np.asarray(tokens, dtype=np.int64)) == full


def test_one_changed_token_changes_its_block_and_every_later_block() -> None:
    h = hasher()
    tokens = list(range(64))
    a = h.hash_blocks(tokens)
    tokens[20] += 1
    b = h.hash_blocks(tokens)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize(
    "extra",
    [ExtraKeys(lora_id="a"), ExtraKeys(encoder_hash=b"x"), ExtraKeys(cache_salt="tenant-1")],
)
def test_extra_keys_change_every_block(extra: ExtraKeys) -> None:
    h = hasher()
    tokens = list(range(48))
    plain, keyed = h.hash_blocks(tokens), h.hash_blocks(tokens, extra)
    assert not set(plain) & set(keyed)
    assert h.hash_blocks(tokens, ExtraKeys()) == plain


def test_seed_algorithm_and_model_are_part_of_the_name() -> None:
    tokens = list(range(32))
    names = {
        tuple(hasher().hash_blocks(tokens)),
        tuple(hasher(seed="other").hash_blocks(tokens)),
        tuple(hasher(algorithm="xxh3_128").hash_blocks(tokens)),
        tuple(BlockHasher(preset_layout("small").fingerprint(), 16).hash_blocks(tokens)),
        tuple(
            BlockHasher(preset_layout("tiny", block_size=32).fingerprint(), 16).hash_blocks(tokens)
        ),
    }
    assert len(names) == 5


def test_block_count_and_order_do_not_change_the_fingerprint() -> None:
    base = preset_layout("tiny").fingerprint()
    assert preset_layout("tiny", num_blocks=7, order="layer-hnd").fingerprint() == base


def test_cross_blocks_are_named_by_encoder_input_only() -> None:
    h = hasher()
    enc = h.encoder_input_hash(b"audio frames")
    assert h.cross_block_hashes(enc, 3) == h.cross_block_hashes(enc, 3)
    assert h.cross_block_hashes(enc, 3)[:2] == h.cross_block_hashes(enc, 2)
    other = h.encoder_input_hash(b"other audio")
    assert not set(h.cross_block_hashes(enc, 3)) & set(h.cross_block_hashes(other, 3))


def test_bad_tokens_and_config_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"0\.\.2\*\*32-1"):
        hasher().hash_blocks([-1] * 16)
    with pytest.raises(ConfigError, match=r"0\.\.2\*\*32-1"):
        hasher().hash_blocks(np.full(16, 2**40))
    with pytest.raises(ConfigError, match="hash_algorithm 'md5'"):
        HashConfig(algorithm="md5")


_CHILD = """
import json, sys
from kvbridge.proto import BlockHasher, ExtraKeys, HashConfig, preset_layout
lay = preset_layout("tiny")
out = {}
for alg in ("sha256", "xxh3_128"):
    h = BlockHasher(lay.fingerprint(), lay.block_size, HashConfig(alg, seed="s"))
    out[alg] = [x.hex() for x in h.hash_blocks(list(range(100)), ExtraKeys(lora_id="l"))]
print(json.dumps(out))
"""


def test_hash_chains_are_identical_across_processes_with_different_hash_seeds() -> None:
    results = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
    here = BlockHasher(LAYOUT.fingerprint(), 16, HashConfig("sha256", seed="s"))
    assert results[0]["sha256"] == [
        x.hex() for x in here.hash_blocks(list(range(100)), ExtraKeys(lora_id="l"))
    ]

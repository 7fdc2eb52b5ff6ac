"""Known answers for block names: the hash format of record, pinned byte for byte.

The constants below were computed once from kvbridge's hashing as of this test's commit.
Block names travel between processes and nodes (kv_transfer_params, the offload daemon's
keys, prefix-cache lookups): CHANGING ANY OF THEM IS A WIRE-FORMAT CHANGE. A deployment
that mixes old and new versions then finds zero hits between them (or, worse, needs a
flag day), so a change here needs a new root tag (``kvbridge-blocks-v2``) and a note in
the release, never a quiet update of these strings.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.proto import BlockHasher, ExtraKeys, HashConfig, preset_layout

FINGERPRINT = bytes(range(32))
SEED = "kat-seed"
BLOCK_SIZE = 4
# two full blocks and a partial one (never named); includes a token past 16 bits and the
# largest uint32, so the little-endian uint32 packing is pinned too
TOKENS = [0, 1, 2, 3, 70000, 2**32 - 1, 5, 6, 7, 8]
EXTRA = ExtraKeys(lora_id="lora-a", encoder_hash=bytes(16), cache_salt="salt-1")

KNOWN: dict[str, dict[str, list[str]]] = {
    "sha256": {
        "plain": [
            "d5216a3f3852cff1df823ab6b001e48d12c86b9a095f0a6a2031a773ba12e6e0",
            "b167442212d90f0343a189aa9a849220de54d88498da7fe5f2caf49dbe51dc95",
        ],
        "extra": [
            "4b207828fdf26c8dd5556026d8ea72a262cb08b5916c648f015cfd14e70e7261",
            "725c8a102e6d1ea939ee8b66cfc13003c31690a81bbe7ec49e8d0e4ad4cb1a1a",
        ],
        "cross": [
            "0e1f658693b388597fdd18400cf05367088c9ccf3b1cf71905a4cf0a6369c9e4",
            "492363661de0e13931a6f5b9fe3cda19d0c3b83896f1ec06ebc416db20096bc2",
        ],
    },
    "xxh3_128": {
        "plain": ["ff53170949c683d6787799cdc1d5ab61", "999affe081b7d1847c6733982e78a94d"],
        "extra": ["ed3df21237a69093561a2c6d4e33a1d4", "6877bef620b1fb0d0b2f419e44a912e9"],
        "cross": ["dd7e1310dbe10ae81f7a770bd38a2edf", "0fa35bb74d1fbb71dd84f4d7c31bf5d1"],
    },
}

# the layout fingerprint roots every chain: the "tiny" preset's, as of this commit
TINY_FINGERPRINT = "4ce4c340383b36cdecb4bf5d07902090df155e53c3ce1e18ce3e642f7b171871"


@pytest.mark.parametrize("algorithm", sorted(KNOWN))
def test_block_names_match_the_format_of_record(algorithm: str) -> None:
    """Wire format: changing these constants breaks mixed-version deployments."""
    hasher = BlockHasher(FINGERPRINT, BLOCK_SIZE, HashConfig(algorithm, seed=SEED))
    known = KNOWN[algorithm]
    assert [h.hex() for h in hasher.hash_blocks(TOKENS)] == known["plain"]
    assert [h.hex() for h in hasher.hash_blocks(np.array(TOKENS, dtype=np.int64))] == known["plain"]
    assert [h.hex() for h in hasher.hash_blocks(TOKENS, EXTRA)] == known["extra"]
    assert [h.hex() for h in hasher.cross_block_hashes(b"enc", 2)] == known["cross"]


@pytest.mark.parametrize("algorithm", sorted(KNOWN))
def test_a_chain_extended_from_its_parent_gives_the_same_names(algorithm: str) -> None:
    hasher = BlockHasher(FINGERPRINT, BLOCK_SIZE, HashConfig(algorithm, seed=SEED))
    first = hasher.hash_blocks(TOKENS[:BLOCK_SIZE], EXTRA)
    rest = hasher.hash_blocks(TOKENS[BLOCK_SIZE:], parent=first[-1])
    assert [h.hex() for h in first + rest] == KNOWN[algorithm]["extra"]


def test_the_tiny_layout_fingerprint_matches_the_format_of_record() -> None:
    """Wire format: the fingerprint roots every block name; changing it is a format change."""
    assert preset_layout("tiny").fingerprint().hex() == TINY_FINGERPRINT

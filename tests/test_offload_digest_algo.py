"""The offload daemon keeps each block's digest algorithm with its digest and hands it to
readers, so a block written from one device is checked with its writer's algorithm on
another (here on CPU, with the device algorithm forced: its CPU reference).

A fake transport stands in for NIXL (the handlers only register the pool and take in WRITE
notifications); the bytes are written into the pool's memory directly, as a WRITE would.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvbridge.connector.control.types import PeerInfo, Role, peer_to_pb
from kvbridge.connector.offload.moves import load_digests
from kvbridge.connector.offload.wire import store_notification
from kvbridge.kernels import ALGO_DEVICE, ALGO_XXH3, block_digests, new_key
from kvbridge.proto import EngineId, KVLayout, WireError, preset_layout
from kvbridge.proto import offload_pb2 as pb
from kvbridge.worker.offload.server import OffloadConfig, OffloadHandlers
from tests.harness.offload import FakeTransport

BLOCKS = 8


def _stored(algo: str, named: str = "") -> tuple[OffloadHandlers, str, list[bytes], KVLayout]:
    """A daemon holding two committed blocks of random bytes, digested with ``algo`` (the
    commit names ``named``, by default ``algo``)."""
    layout = preset_layout("tiny", num_blocks=16)
    transport = FakeTransport()
    h = OffloadHandlers(
        transport,  # type: ignore[arg-type]
        OffloadConfig(capacity_bytes=BLOCKS * layout.block_bytes()),
        instance="0" * 32,
    )
    peer = PeerInfo(EngineId("w"), Role.BOTH, layout, b"md")
    session = h.handshake(pb.OffloadHandshakeRequest(peer=peer_to_pb(peer), agent_name="w")).session
    hs = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
    prep = h.prepare_store(pb.PrepareStoreRequest(instance=h.instance, hashes=hs, session=session))
    pool = h._state.memory.layout  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(5)
    for t in h._state.caches.values():  # type: ignore[union-attr]
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    key = new_key()
    slots = list(prep.slots)
    digests = block_digests(pool, "self", slots, key, algo)
    transport.notifications["w"] = [store_notification(prep.store_id)]
    h.commit_store(
        pb.CommitStoreRequest(
            store_id=prep.store_id,
            session=session,
            digest_key=key,
            digests=digests,
            digest_algo=named or algo,
        )
    )
    return h, session, hs, pool


@pytest.mark.parametrize("algo", [ALGO_XXH3, ALGO_DEVICE])
def test_prepare_load_hands_readers_the_writers_algorithm(algo: str) -> None:
    h, session, hs, pool = _stored(algo)
    resp = h.prepare_load(pb.PrepareLoadRequest(instance=h.instance, hashes=hs, session=session))
    assert list(resp.digest_algos) == [algo, algo]
    got = load_digests(resp, len(resp.slots))
    # a reader computing the algorithm it was handed matches every block; computing its own
    # default (XXH3 over CPU memory) instead would not, for a device-written block
    for slot, (key, want, named) in zip(resp.slots, got, strict=True):
        assert block_digests(pool, "self", [slot], key, named)[0] == want
        other = ALGO_XXH3 if algo == ALGO_DEVICE else ALGO_DEVICE
        assert block_digests(pool, "self", [slot], key, other)[0] != want
    # a reader's false report of a bad block is checked with the writer's algorithm: the
    # daemon finds it good and keeps it
    done = h.complete_load(pb.CompleteLoadRequest(load_id=resp.load_id, session=session, bad=[0]))
    assert done.dropped == 0 and done.released


def test_an_unknown_algorithm_is_refused_at_commit_and_in_a_reply() -> None:
    with pytest.raises(WireError, match="algorithm"):
        _stored(ALGO_XXH3, named="md5")
    resp = pb.PrepareLoadResponse(
        slots=[1], digest_keys=[1], digests=[bytes(16)], digest_algos=["md5"]
    )
    with pytest.raises(WireError):
        load_digests(resp, 1)
    # a daemon that names no algorithm (from before they travelled) means XXH3
    old = pb.PrepareLoadResponse(slots=[1], digest_keys=[1], digests=[bytes(16)])
    assert load_digests(old, 1) == [(1, bytes(16), ALGO_XXH3)]

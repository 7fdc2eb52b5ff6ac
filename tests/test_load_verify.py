"""Digests in kv_transfer_params and the reader's check, without a network.

The end-to-end attacks (a token holder WRITing prefill's NIXL memory) are in
tests/test_attack_nixl_write.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pytest
import torch

from kvbridge.connector import ConnectorConfig, KVTransferParams, RequestView
from kvbridge.connector.load.verify import Expected
from kvbridge.connector.planner import KVBridgePlanner, LeaseIssuer
from kvbridge.connector.vllm.scheduler import from_json_params, to_json_params
from kvbridge.kernels import block_digests, new_key
from kvbridge.proto import (
    BlockHash,
    BlockId,
    ConfigError,
    KVLayout,
    LeaseId,
    RequestId,
    WireError,
    preset_layout,
)

BS = 16
D = [bytes([i]) * 16 for i in range(3)]


def params(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "remote_engine_id": "prefill-a",
        "remote_address": "127.0.0.1:7600",
        "request_id": "r1",
        "num_tokens": 2 * BS + 1,
        "block_ids": {"self": [3, 4, 5]},
        "block_hashes": {"self": [b"h" * 16, b"g" * 16]},
        "lease_id": "lease-1",
        "lease_ttl_s": 30.0,
        "digest_key": (1 << 64) - 1,
        "digests": {"self": D},
    }
    return {**base, **over}


def test_digests_round_trip_through_the_params_and_vllm_json() -> None:
    parsed = KVTransferParams.parse(params(), BS)
    assert parsed.digest_key == (1 << 64) - 1 and parsed.digests == {"self": tuple(D)}
    wire = json.loads(json.dumps(to_json_params(parsed.to_dict())))
    assert KVTransferParams.parse(from_json_params(wire) or {}, BS) == parsed
    bare = KVTransferParams.parse({k: v for k, v in params().items() if "digest" not in k}, BS)
    assert bare.digest_key is None and "digest_key" not in bare.to_dict()


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"digest_key": -1}, "digest_key"),
        ({"digest_key": 1 << 64}, "digest_key"),
        ({"digest_key": True}, "digest_key"),
        ({"digest_key": "7"}, "digest_key"),
        ({"digests": {"self": D[:2]}}, "one digest per 'self'"),
        ({"digests": {"self": [b"x" * 15, *D[1:]]}}, "16 bytes"),
        ({"digests": {"self": ["00" * 16, *D[1:]]}}, "16 bytes"),
        ({"digests": {"evil": D}}, "bad group"),
        ({"digests": [D]}, "digests"),
    ],
)
def test_a_malformed_digest_field_is_a_wire_error(over: dict[str, object], match: str) -> None:
    with pytest.raises(WireError, match=match):
        KVTransferParams.parse(params(**over), BS)


def test_the_switch_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="verify_loads"):
        ConnectorConfig(engine_id="e", verify_loads="no")


def _filled(order: str) -> tuple[KVLayout, dict[str, torch.Tensor]]:
    layout = preset_layout("tiny", num_blocks=8, order=order)
    caches = layout.allocate()
    gen = torch.Generator().manual_seed(1)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return layout.bind(caches), caches


@pytest.mark.parametrize("order", ["block-nhd", "layer-hnd"])
def test_the_check_stops_at_the_first_block_that_differs_and_counts_every_one(order: str) -> None:
    layout, caches = _filled(order)
    key = new_key()
    ids = [BlockId(b) for b in (5, 1, 2, 7)]
    expected = Expected(key, {"self": block_digests(layout, "self", ids, key)})
    assert expected.check(layout, "self", ids) == (4, 0)
    first = next(iter(caches.values()))
    _poke(first, layout, 1)
    _poke(first, layout, 7)
    assert expected.check(layout, "self", ids) == (1, 2)
    other = Expected(key ^ 1, expected.digests)  # another hand-over's key: nothing matches
    assert other.check(layout, "self", ids).good == 0


def _poke(tensor: torch.Tensor, layout: KVLayout, block: int) -> None:
    """Change one value of ``block`` in one layer's view (logical (2, blocks, ...))."""
    tensor[0, block, 0, 0, 3] += 1.0


def test_blocks_without_digests_fail_closed() -> None:
    layout, _ = _filled("block-nhd")
    key = new_key()
    ids = [BlockId(0), BlockId(1)]
    short = Expected(key, {"self": block_digests(layout, "self", ids[:1], key)})
    assert short.check(layout, "self", ids) == (0, 2)
    assert Expected(key, {}).check(layout, "cross", ids) == (0, 2)


class _Issuer(LeaseIssuer):
    def __init__(self, digests: dict[str, list[bytes]] | None) -> None:
        self._digests = digests
        self.asked: list[int] = []

    def verified_prefix(
        self, group: str, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> int:
        return len(block_ids)

    def lease_request(
        self, request_id: RequestId, blocks: Mapping[str, Sequence[BlockId]], hashes: object
    ) -> tuple[LeaseId, float]:
        return LeaseId("ab" * 16), 30.0

    def digests(
        self, blocks: Mapping[str, Sequence[BlockId]], key: int
    ) -> dict[str, list[bytes]] | None:
        self.asked.append(key)
        return self._digests


@pytest.mark.parametrize(
    ("verify", "digests", "carried"),
    [(True, {"self": D[:2]}, True), (False, {"self": D[:2]}, False), (True, None, False)],
)
def test_prefill_hands_over_digests_only_when_verifying_and_able(
    verify: bool, digests: dict[str, list[bytes]] | None, carried: bool
) -> None:
    config = ConnectorConfig(
        engine_id="p", role="prefill", control_address="a:1", verify_loads=verify
    )
    sched = KVBridgePlanner(config, BS)
    issuer = _Issuer(digests)
    sched.attach(issuer)
    prompt = list(range(1, 2 * BS + 1))
    view = RequestView(
        RequestId("r"),
        prompt,
        {"self": [BlockHash(b"h" * 32), BlockHash(b"g" * 32)]},
        {"do_remote_decode": True},
    )
    _, out = sched.request_finished(view, {"self": [BlockId(3), BlockId(4)]})
    assert out is not None
    assert ("digests" in out) is carried and ("digest_key" in out) is carried
    if carried:
        assert out["digest_key"] == issuer.asked[0] and out["digests"] == {"self": D[:2]}
    assert len(issuer.asked) == (1 if verify else 0)

"""Attacks on kv_transfer_params as a router forwards them (JSON allows NaN and Infinity):
every field is a WireError unless it is a value prefill could have sent."""

from __future__ import annotations

import json
import math

import pytest

from kvbridge.connector import KVTransferParams
from kvbridge.connector.vllm.scheduler import from_json_params, to_json_params
from kvbridge.proto import WireError

BS = 16


def params(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "remote_engine_id": "prefill-a",
        "remote_address": "127.0.0.1:7600",
        "request_id": "r1",
        "num_tokens": 2 * BS,
        "block_ids": {"self": [3, 4]},
        "block_hashes": {"self": [b"h" * 16, b"g" * 16]},
        "lease_id": "lease-1",
        "lease_ttl_s": 30.0,
        "tp_size": 2,
    }
    return {**base, **over}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0, -1, True, "30"])
def test_a_lease_ttl_that_is_not_a_finite_positive_number_is_a_wire_error(bad: object) -> None:
    with pytest.raises(WireError, match="lease_ttl_s"):
        KVTransferParams.parse(params(lease_ttl_s=bad), BS)


def test_json_nan_from_a_router_is_refused() -> None:
    wire = json.dumps(to_json_params(params(lease_ttl_s=math.nan)))  # 'NaN' in the JSON
    assert "NaN" in wire
    raw = from_json_params(json.loads(wire))
    assert raw is not None
    with pytest.raises(WireError, match="lease_ttl_s"):
        KVTransferParams.parse(raw, BS)


def test_honest_params_round_trip() -> None:
    got = KVTransferParams.parse(params(), BS)
    assert KVTransferParams.parse(got.to_dict(), BS) == got
    assert got.tp_size == 2 and got.lease_ttl_s == 30.0

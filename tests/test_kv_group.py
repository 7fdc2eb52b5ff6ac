"""``KVGroup``: one name for the KV-cache groups, the same bytes on every wire, and a peer's
group string parsed once at the edge (a typed error when it names no group)."""

from __future__ import annotations

import json

import msgpack
import pytest

from kvbridge.connector import KVTransferParams
from kvbridge.proto import (
    KVGroup,
    KVLayout,
    LayoutError,
    WireError,
    codec,
    control_pb2,
    parse_group,
    preset_layout,
)

BS = 16


def test_a_group_is_its_string_in_msgpack_json_and_protobuf() -> None:
    assert [g.value for g in KVGroup] == ["self", "cross", *(f"g{i}" for i in range(64))]
    members = {KVGroup.SELF: [1, 2], KVGroup.CROSS: [3]}
    strings = {"self": [1, 2], "cross": [3]}
    assert msgpack.packb(members) == msgpack.packb(strings)
    assert json.dumps(members) == json.dumps(strings)
    for g in KVGroup:
        as_member = control_pb2.GroupHashes(group=g, hashes=[b"h" * 16])
        as_string = control_pb2.GroupHashes(group=g.value, hashes=[b"h" * 16])
        assert as_member.SerializeToString() == as_string.SerializeToString()
    # a map keyed by members answers a lookup by the wire string, and the other way round
    assert members["cross"] == [3] and strings[KVGroup.SELF] == [1, 2]
    # messages read as before the enum: the value's repr
    assert f"{KVGroup.CROSS!r} {KVGroup.SELF}" == "'cross' self"


def test_a_layout_from_the_wire_names_its_groups_with_members() -> None:
    sent = preset_layout("encdec-tiny")
    got = KVLayout.from_bytes(sent.to_bytes())
    assert got == sent
    assert [type(g.name) for g in got.groups] == [KVGroup, KVGroup]
    assert {type(x.group) for x in got.layers} == {KVGroup}


def test_a_layout_naming_an_unknown_group_is_a_layout_error() -> None:
    body = codec.unpack(preset_layout("encdec-tiny").to_bytes(), "KVLayout")
    body["groups"] = ["self", "evil"]
    with pytest.raises(LayoutError, match="unknown group 'evil'"):
        KVLayout.from_bytes(codec.pack("KVLayout", body))
    body = codec.unpack(preset_layout("tiny").to_bytes(), "KVLayout")
    body["layers"][0][1] = "evil"
    with pytest.raises(LayoutError, match="unknown group 'evil'"):
        KVLayout.from_bytes(codec.pack("KVLayout", body))


def test_transfer_params_from_a_router_carry_members_and_refuse_other_groups() -> None:
    raw: dict[str, object] = {
        "remote_engine_id": "prefill-a",
        "remote_address": "127.0.0.1:7600",
        "request_id": "r1",
        "num_tokens": 2 * BS,
        "block_ids": {"self": [3, 4], "cross": [7]},
        "block_hashes": {"self": [b"h" * 16, b"g" * 16], "cross": [b"c" * 16]},
        "lease_id": "lease-1",
        "lease_ttl_s": 30.0,
    }
    got = KVTransferParams.parse(raw, BS)
    assert [type(g) for g in got.block_ids] == [KVGroup, KVGroup]
    assert [type(g) for g in got.block_hashes] == [KVGroup, KVGroup]
    for bad in ("evil", b"self", 1):
        with pytest.raises(WireError, match="bad group"):
            KVTransferParams.parse({**raw, "block_ids": {bad: [3, 4]}}, BS)


@pytest.mark.parametrize("bad", ["evil", "SELF", "", b"self", None, 0])
def test_parse_group_raises_the_callers_typed_error_naming_the_value(bad: object) -> None:
    with pytest.raises(
        WireError, match=r"unknown group .*groups are 'self', 'cross' and 'g0'..'g63'"
    ):
        parse_group(bad, WireError)
    with pytest.raises(LayoutError, match="unknown group"):
        parse_group(bad)
    assert parse_group("cross") is KVGroup.CROSS

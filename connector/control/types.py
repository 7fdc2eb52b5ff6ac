"""Typed values of the peer control plane and their protobuf conversions.

Both ends use this module: the client in the engine (:mod:`control_client`)
and the server in kvbridge's processes (:mod:`kvbridge.connector.control.server`).
Every id, count and size that arrives from a peer passes one of the ``check_*``
functions here before it is used; they raise :class:`WireError` (mapped to
``INVALID_ARGUMENT``) naming the bad value. Importing this module loads
protobuf but not gRPC.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.connector.control.seal import is_seal_layout
from kvbridge.proto import control_pb2 as pb
from kvbridge.proto.errors import ConfigError, VersionMismatchError, WireError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.negotiate import TransferMode
from kvbridge.proto.types import BlockHash, BlockId, EngineId, LeaseId, RequestId
from kvbridge.proto.version import PROTOCOL_VERSION

__all__ = [
    "HandOverDigests",
    "ControlLimits",
    "Role",
    "PeerInfo",
    "PinnedBlocks",
    "HealthInfo",
    "check_engine_id",
    "check_request_id",
    "check_lease_id",
    "check_hash",
    "check_hashes",
    "peer_to_pb",
    "peer_from_pb",
    "mode_to_pb",
    "mode_from_pb",
    "role_to_pb",
    "role_from_pb",
]

_LEASE_ID = re.compile(r"[0-9a-f]{32}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no spaces or control characters
_MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ControlLimits:
    """Bounds on what a peer may send; the same defaults on both ends."""

    max_message_bytes: int = 16 * _MiB
    max_layout_bytes: int = 1 * _MiB
    max_agent_metadata_bytes: int = 8 * _MiB
    max_hashes_per_group: int = 1 << 16
    min_hash_bytes: int = 8
    max_hash_bytes: int = 64
    max_engine_id_chars: int = 128
    max_request_id_chars: int = 256
    max_address_chars: int = 256
    max_lease_ids_per_heartbeat: int = 1024

    def __post_init__(self) -> None:
        for knob in self.__slots__:
            if getattr(self, knob) < 1:
                raise ConfigError(f"ControlLimits.{knob} must be >= 1, got {getattr(self, knob)}")
        if self.min_hash_bytes > self.max_hash_bytes:
            raise ConfigError("ControlLimits.min_hash_bytes exceeds max_hash_bytes")
        need = self.max_layout_bytes + self.max_agent_metadata_bytes + 4096
        if self.max_message_bytes < need:
            raise ConfigError(
                f"ControlLimits.max_message_bytes={self.max_message_bytes} cannot carry a "
                f"handshake of {need} bytes; raise it or lower the layout/metadata limits"
            )


class Role(enum.Enum):
    """What a kvbridge process does with its KV memory."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    OFFLOAD = "offload"


_ROLE_TO_PB: Mapping[Role, int] = {
    Role.PREFILL: pb.ROLE_PREFILL,
    Role.DECODE: pb.ROLE_DECODE,
    Role.BOTH: pb.ROLE_BOTH,
    Role.OFFLOAD: pb.ROLE_OFFLOAD,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}

_MODE_TO_PB: Mapping[TransferMode, int] = {
    TransferMode.WHOLE_BLOCK: pb.TRANSFER_MODE_WHOLE_BLOCK,
    TransferMode.PER_SPAN: pb.TRANSFER_MODE_PER_SPAN,
    TransferMode.REARRANGE: pb.TRANSFER_MODE_REARRANGE,
    TransferMode.HEAD_SLICE: pb.TRANSFER_MODE_HEAD_SLICE,
}
_MODE_FROM_PB = {v: k for k, v in _MODE_TO_PB.items()}


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """Who a peer is: sent in the handshake, answered with the other side's own.

    ``tp_rank``/``tp_size`` travel on the wire from ``layout``.
    """

    engine_id: EngineId
    role: Role
    layout: KVLayout
    agent_metadata: bytes = b""
    control_address: str = ""
    protocol_version: int = PROTOCOL_VERSION
    seal_layout: KVLayout | None = None
    """The peer's lease seal table (registered memory), if it publishes seals."""


@dataclass(frozen=True, slots=True)
class PinnedBlocks:
    """Blocks a peer pinned for us; release ``lease_id`` when done reading.

    ``lease_id`` is None when nothing was pinned (no prefix block was
    present): there is nothing to read and nothing to release.
    """

    lease_id: LeaseId | None
    expires_in_s: float
    blocks: Mapping[KVGroup, tuple[BlockId, ...]] = field(default_factory=dict)
    hashes: Mapping[KVGroup, tuple[BlockHash, ...]] = field(default_factory=dict)
    request_id: RequestId | None = None

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.blocks.values())


@dataclass(frozen=True, slots=True)
class HealthInfo:
    engine_id: EngineId
    role: Role | None
    protocol_version: int
    num_leases: int


# ----------------------------------------------------------------------------- checks


def check_engine_id(value: str, limits: ControlLimits) -> EngineId:
    if not isinstance(value, str) or not _PRINTABLE.fullmatch(value):
        raise WireError(f"engine id {value!r} must be non-empty visible ASCII without spaces")
    if len(value) > limits.max_engine_id_chars:
        raise WireError(
            f"engine id of {len(value)} chars exceeds the {limits.max_engine_id_chars}-char limit"
        )
    return EngineId(value)


def check_request_id(value: str, limits: ControlLimits) -> RequestId:
    if not isinstance(value, str) or not value or len(value) > limits.max_request_id_chars:
        raise WireError(f"request id {value[:64]!r} must be 1..{limits.max_request_id_chars} chars")
    if not value.isprintable():
        raise WireError(f"request id {value[:64]!r} contains non-printable characters")
    return RequestId(value)


def check_lease_id(value: str) -> LeaseId:
    if not isinstance(value, str) or not _LEASE_ID.fullmatch(value):
        raise WireError(f"lease id {value[:64]!r} is not 32 lowercase hex digits")
    return LeaseId(value)


def check_hash(value: bytes, limits: ControlLimits) -> BlockHash:
    if not limits.min_hash_bytes <= len(value) <= limits.max_hash_bytes:
        raise WireError(
            f"block hash of {len(value)} bytes is outside "
            f"{limits.min_hash_bytes}..{limits.max_hash_bytes} bytes"
        )
    return BlockHash(bytes(value))


def check_hashes(values: Sequence[bytes], limits: ControlLimits) -> list[BlockHash]:
    """:func:`check_hash` for a whole group at once (the ``Pin`` hot path)."""
    lo, hi = limits.min_hash_bytes, limits.max_hash_bytes
    if all(lo <= n <= hi for n in set(map(len, values))):
        return [BlockHash(bytes(v)) for v in values]
    for v in values:
        check_hash(v, limits)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------ conversions


def peer_to_pb(peer: PeerInfo) -> pb.PeerInfo:
    return pb.PeerInfo(
        protocol_version=peer.protocol_version,
        engine_id=peer.engine_id,
        role=_ROLE_TO_PB[peer.role],  # type: ignore[arg-type]
        tp_rank=peer.layout.tp_rank,
        tp_size=peer.layout.tp_size,
        layout=peer.layout.to_bytes(),
        agent_metadata=peer.agent_metadata,
        control_address=peer.control_address,
        seal_layout=b"" if peer.seal_layout is None else peer.seal_layout.to_bytes(),
    )


def peer_from_pb(msg: pb.PeerInfo, limits: ControlLimits) -> PeerInfo:
    """Validate a peer's info; the protocol version is checked first.

    Raises :class:`VersionMismatchError` naming both versions, else
    :class:`WireError`/:class:`LayoutError` naming the bad field.
    """
    if msg.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"peer speaks control protocol version {msg.protocol_version}, this kvbridge "
            f"speaks version {PROTOCOL_VERSION}; run the same kvbridge version on both sides"
        )
    engine_id = check_engine_id(msg.engine_id, limits)
    role = _ROLE_FROM_PB.get(msg.role)
    if role is None:
        raise WireError(f"peer {engine_id}: unknown role {msg.role}")
    if len(msg.layout) > limits.max_layout_bytes:
        raise WireError(
            f"peer {engine_id}: layout of {len(msg.layout)} bytes exceeds the "
            f"{limits.max_layout_bytes}-byte limit"
        )
    if len(msg.agent_metadata) > limits.max_agent_metadata_bytes:
        raise WireError(
            f"peer {engine_id}: agent metadata of {len(msg.agent_metadata)} bytes exceeds the "
            f"{limits.max_agent_metadata_bytes}-byte limit"
        )
    if len(msg.control_address) > limits.max_address_chars or not (
        msg.control_address == "" or _PRINTABLE.fullmatch(msg.control_address)
    ):
        raise WireError(f"peer {engine_id}: control address {msg.control_address[:64]!r} is bad")
    layout = KVLayout.from_bytes(msg.layout, max_bytes=limits.max_layout_bytes)
    if (msg.tp_rank, msg.tp_size) != (layout.tp_rank, layout.tp_size):
        raise WireError(
            f"peer {engine_id}: tp rank/size {msg.tp_rank}/{msg.tp_size} disagree with its "
            f"layout's {layout.tp_rank}/{layout.tp_size}"
        )
    seal = None
    if msg.seal_layout:
        seal = KVLayout.from_bytes(msg.seal_layout, max_bytes=limits.max_layout_bytes)
        if not is_seal_layout(seal):
            raise WireError(f"peer {engine_id}: its seal_layout is not a seal table's layout")
    return PeerInfo(
        engine_id=engine_id,
        role=role,
        layout=layout,
        agent_metadata=bytes(msg.agent_metadata),
        control_address=msg.control_address,
        protocol_version=msg.protocol_version,
        seal_layout=seal,
    )


def mode_to_pb(mode: TransferMode) -> int:
    return _MODE_TO_PB[mode]


def mode_from_pb(value: int) -> TransferMode:
    mode = _MODE_FROM_PB.get(value)
    if mode is None:
        raise WireError(f"unknown transfer mode {value}")
    return mode


def role_to_pb(role: Role) -> int:
    return _ROLE_TO_PB[role]


def role_from_pb(value: int) -> Role | None:
    return _ROLE_FROM_PB.get(value)


@dataclass(frozen=True, slots=True)
class HandOverDigests:
    """What a hand-over lease's owner recorded of its blocks (kept in its own memory, sent by
    ``Digests``): ``algo`` (a :mod:`kvbridge.kernels.digest` algorithm name) and, per group,
    one digest per leased block."""

    algo: str
    groups: Mapping[KVGroup, Sequence[bytes]]
    heads: int = 0
    """Head-slice digests per block in ``head_groups`` (0: none; see
    :func:`kvbridge.kernels.page_slice_digests`): what a reader of a bigger TP size, which
    reads a run of each page's heads, checks."""
    head_groups: Mapping[KVGroup, Sequence[bytes]] = field(default_factory=dict)
    """Per group, ``heads`` digests per leased block, block after block (always XXH3)."""

"""kvbridge's contract: layouts, block identity, the wire codec and error types.

Importing this package loads no torch, NIXL, gRPC or CUDA code (a test pins
that); tensor helpers live in :mod:`kvbridge.proto.tensors`.
"""

from kvbridge.proto.errors import (
    AuthError,
    BlockPoolError,
    ConfigError,
    ControlPlaneError,
    IncompatibleLayoutError,
    KVBridgeError,
    LayoutError,
    LeaseError,
    OutOfBlocksError,
    PeerError,
    TransferError,
    TransferTimeoutError,
    VersionMismatchError,
    WireError,
)
from kvbridge.proto.hashing import BlockHasher, ExtraKeys, HashConfig
from kvbridge.proto.layout import (
    DIMS,
    ORDERS,
    GroupSpec,
    KVGroup,
    KVLayout,
    LayerSpec,
    ModelSpec,
    Region,
    Span,
    parse_group,
    parse_order,
)
from kvbridge.proto.negotiate import Negotiation, TransferMode, negotiate
from kvbridge.proto.presets import PRESETS, make_layout, preset_layout
from kvbridge.proto.specs import attention_group, is_attention_group
from kvbridge.proto.types import BlockHash, BlockId, EngineId, LeaseId, RequestId
from kvbridge.proto.version import PROTOCOL_VERSION, SCHEMA_VERSION, __version__

__all__ = [
    "AuthError",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "BlockPoolError",
    "ConfigError",
    "ControlPlaneError",
    "DIMS",
    "EngineId",
    "ExtraKeys",
    "GroupSpec",
    "HashConfig",
    "KVGroup",
    "IncompatibleLayoutError",
    "KVBridgeError",
    "KVLayout",
    "LayerSpec",
    "LayoutError",
    "LeaseError",
    "LeaseId",
    "ModelSpec",
    "Negotiation",
    "ORDERS",
    "OutOfBlocksError",
    "PRESETS",
    "PROTOCOL_VERSION",
    "PeerError",
    "Region",
    "RequestId",
    "SCHEMA_VERSION",
    "Span",
    "TransferError",
    "TransferMode",
    "TransferTimeoutError",
    "VersionMismatchError",
    "WireError",
    "__version__",
    "attention_group",
    "is_attention_group",
    "make_layout",
    "negotiate",
    "parse_group",
    "parse_order",
    "preset_layout",
]

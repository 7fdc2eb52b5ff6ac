"""The msgpack envelope every kvbridge structure travels in.

A message is ``{"v": SCHEMA_VERSION, "kind": <str>, "body": <map>}``. Decoding
checks size before parsing, bounds every container msgpack builds, rejects an
unknown version with a message naming both versions, and never unpickles.
Bodies are read with :func:`take`, which type-checks one field at a time so a
malformed peer message becomes a :class:`WireError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack

from kvbridge.proto.errors import VersionMismatchError, WireError
from kvbridge.proto.version import SCHEMA_VERSION

__all__ = ["MAX_MESSAGE_BYTES", "pack", "unpack", "take"]

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_MAX_CONTAINER = 1 << 20

T = TypeVar("T")


def pack(kind: str, body: Mapping[str, Any]) -> bytes:
    """Serialise ``body`` as a versioned message of type ``kind``."""
    data: bytes = msgpack.packb(
        {"v": SCHEMA_VERSION, "kind": kind, "body": dict(body)}, use_bin_type=True
    )
    return data


def unpack(data: bytes, kind: str, *, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """Parse a message of type ``kind`` and return its body.

    Raises :class:`WireError` for oversize or malformed input and
    :class:`VersionMismatchError` for another schema version.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"{kind}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"{kind}: message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=_MAX_CONTAINER,
            max_map_len=_MAX_CONTAINER,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"{kind}: not a valid msgpack message ({exc})") from None
    if not isinstance(msg, dict) or not {"v", "kind", "body"} <= msg.keys():
        raise WireError(f"{kind}: message is not a kvbridge envelope")
    if msg["v"] != SCHEMA_VERSION:
        raise VersionMismatchError(
            f"{kind}: peer sent schema version {msg['v']!r}, this kvbridge speaks "
            f"version {SCHEMA_VERSION}; run the same kvbridge version on both sides"
        )
    if msg["kind"] != kind:
        raise WireError(f"expected a {kind} message, got {msg['kind']!r}")
    body = msg["body"]
    if not isinstance(body, dict):
        raise WireError(f"{kind}: body is not a map")
    return body


def take(body: Mapping[str, Any], name: str, typ: type[T] | tuple[type, ...]) -> T:
    """Return ``body[name]`` if present and of type ``typ``, else raise WireError."""
    if name not in body:
        raise WireError(f"missing field {name!r}")
    value = body[name]
    # bool is an int subclass; never accept it where an int is meant
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
        want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise WireError(f"field {name!r} must be {want}, got {type(value).__name__}")
    return value  # type: ignore[return-value]

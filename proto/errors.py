"""The typed errors kvbridge raises at its API boundaries.

Every error a caller can act on is a :class:`KVBridgeError`. Messages name the
bad value and, where there is one, the fix. Transfer failures inside an
engine step come back as results, not exceptions (fail closed: a request
whose KV did not arrive whole is recomputed); the exceptions here are for bad
input, bad configuration and broken peers at the edges.
"""

from __future__ import annotations

__all__ = [
    "KVBridgeError",
    "ConfigError",
    "LayoutError",
    "IncompatibleLayoutError",
    "WireError",
    "VersionMismatchError",
    "BlockPoolError",
    "OutOfBlocksError",
    "TransferError",
    "TransferTimeoutError",
    "PeerError",
    "ControlPlaneError",
    "AuthError",
    "LeaseError",
]


class KVBridgeError(Exception):
    """Base class of every error kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """A configuration knob has a bad value; the message names the knob."""


class LayoutError(KVBridgeError, ValueError):
    """A KV layout or KV tensors cannot be described, built or used as asked."""


class IncompatibleLayoutError(LayoutError):
    """Two peers' layouts cannot exchange blocks; ``reason`` names the field."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WireError(KVBridgeError, ValueError):
    """A message from a peer is malformed, oversized or of an unknown schema."""


class VersionMismatchError(WireError):
    """A message or peer speaks a schema/protocol version we do not."""


class BlockPoolError(KVBridgeError):
    """A block pool operation was asked with ids or state that do not allow it."""


class OutOfBlocksError(BlockPoolError):
    """Not enough free blocks; nothing was allocated."""


class TransferError(KVBridgeError):
    """A data-plane transfer failed; the handle has been released."""


class TransferTimeoutError(TransferError):
    """A transfer did not finish before its deadline; the handle has been released."""


class PeerError(KVBridgeError):
    """A peer is unknown, unreachable, or went away."""


class ControlPlaneError(KVBridgeError):
    """A control-plane call failed; ``code`` is the gRPC status code name."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.code = code


class AuthError(ControlPlaneError):
    """The peer rejected our credentials (or we rejected theirs)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="UNAUTHENTICATED")


class LeaseError(ControlPlaneError):
    """A lease is unknown, expired, or does not cover the blocks asked for."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="FAILED_PRECONDITION")

"""Identity types shared by every kvbridge process.

They are ``NewType`` aliases so that a block id is never passed where a block
hash is expected, at no runtime cost.
"""

from __future__ import annotations

from typing import NewType

__all__ = ["BlockHash", "BlockId", "RequestId", "EngineId", "LeaseId"]

BlockHash = NewType("BlockHash", bytes)
"""Chained hash naming a full block of tokens (see :mod:`kvbridge.proto.hashing`)."""

BlockId = NewType("BlockId", int)
"""Index of a block in one KV-cache group of one worker."""

RequestId = NewType("RequestId", str)
EngineId = NewType("EngineId", str)
LeaseId = NewType("LeaseId", str)

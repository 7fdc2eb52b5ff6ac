"""``kv_transfer_params``: what prefill hands decode (through the router) for one request.

``block_ids`` and ``block_hashes`` map group names to lists: ``self`` (the
prompt's blocks, one hash per *full* block), for hybrid models further
attention groups ``g<i>`` (the group's blocks of the prompt's last positions,
e.g. a sliding window's; one name per block, a partial last one included) and,
for encoder-decoder models, ``cross`` (the request's cross-attention blocks,
one hash per block).

They travel as a plain map inside the router's request (msgpack on the wire,
a dict inside engines, as vLLM passes them). :meth:`KVTransferParams.parse`
validates every field and bounds every list before anything acts on it, so a
malformed or hostile map becomes a :class:`WireError`, and the request is
recomputed instead of read from wrong memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.kernels.digest import ALGO_DEVICE, ALGO_XXH3, DIGEST_BYTES
from kvbridge.proto.errors import WireError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.specs import MAX_ATTENTION_GROUPS
from kvbridge.proto.types import BlockHash, BlockId, EngineId, LeaseId, RequestId

__all__ = ["KVTransferParams", "MAX_BLOCKS_PER_REQUEST", "MAX_ID_CHARS", "MAX_TP_SIZE"]

MAX_BLOCKS_PER_REQUEST = 1 << 16
MAX_TP_SIZE = 1024
"""Largest prefill tensor-parallel size a request may claim."""
MAX_ID_CHARS = 256
"""Longest id or address string (request ids included, at the Inference edge too)."""
_MAX_STR = MAX_ID_CHARS
DIGEST_ALGOS = (ALGO_XXH3, ALGO_DEVICE)
"""The digest algorithms a hand-over may name (:mod:`kvbridge.kernels.digest`)."""


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """Where a finished prefill's KV is and how long it stays pinned."""

    remote_engine_id: EngineId
    remote_address: str
    request_id: RequestId
    num_tokens: int
    block_ids: Mapping[KVGroup, tuple[BlockId, ...]]
    block_hashes: Mapping[KVGroup, tuple[BlockHash, ...]]
    lease_id: LeaseId
    lease_ttl_s: float
    tp_size: int = 1
    """The prefill's tensor-parallel size: its rank ``r`` holds the ``r``-th slice of the KV
    heads and serves control at ``remote_address``'s port ``+ r``. Absent: 1."""
    digest_key: int | None = None
    """The hand-over's secret digest key (:func:`kvbridge.kernels.new_key`); None: the
    prefill recorded no digests and the load is not verified."""
    digests: Mapping[KVGroup, tuple[bytes, ...]] = field(default_factory=dict)
    """Per group, one digest per entry of ``block_ids`` (:func:`kvbridge.kernels.block_digests`
    of the bytes at hand-over, keyed with ``digest_key``)."""
    digest_algo: str = ALGO_XXH3
    """The algorithm of ``digests`` (a reader computes the same one wherever its bytes
    landed). Absent: XXH3. With ``digests_at_owner`` the owner's ``Digests`` reply names it."""
    digests_at_owner: bool = False
    """The digests are not here: the owner records them when it makes the lease (vLLM: in
    its worker process) and the reader asks its control server for them (``Digests``)."""

    def leased_whole(self, remote: Mapping[KVGroup, Sequence[BlockId]]) -> bool:
        """Whether ``remote`` (a load's ids per group) is every block of the lease, in
        lease order."""
        leased = {g: tuple(ids) for g, ids in self.block_ids.items() if ids}
        return bool(leased) and all(tuple(remote.get(g, ())) == ids for g, ids in leased.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "remote_engine_id": self.remote_engine_id,
            "remote_address": self.remote_address,
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "block_ids": {g: list(ids) for g, ids in self.block_ids.items()},
            "block_hashes": {g: list(h) for g, h in self.block_hashes.items()},
            "lease_id": self.lease_id,
            "lease_ttl_s": self.lease_ttl_s,
            "tp_size": self.tp_size,
            **(
                {}
                if self.digest_key is None
                else {
                    "digest_key": self.digest_key,
                    "digest_algo": self.digest_algo,
                    **(
                        {"digests_at_owner": True}
                        if self.digests_at_owner
                        else {"digests": {g: list(d) for g, d in self.digests.items()}}
                    ),
                }
            ),
        }

    @staticmethod
    def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
        """Whether ``params`` came from a prefill worker (decode should load)."""
        return params is not None and "remote_engine_id" in params

    @classmethod
    def parse(cls, params: Mapping[str, Any], block_size: int) -> KVTransferParams:
        """Validate a peer's map; raises WireError naming the bad field."""
        try:
            out = cls(
                remote_engine_id=EngineId(_str(params, "remote_engine_id")),
                remote_address=_str(params, "remote_address"),
                request_id=RequestId(_str(params, "request_id")),
                num_tokens=_int(params, "num_tokens"),
                block_ids=_group_map(params, "block_ids", _block_id),
                block_hashes=_group_map(params, "block_hashes", _hash),
                lease_id=LeaseId(_str(params, "lease_id")),
                lease_ttl_s=float(_num(params, "lease_ttl_s")),
                tp_size=_int(params, "tp_size") if "tp_size" in params else 1,
                digest_key=_key(params) if "digest_key" in params else None,
                digests=(
                    _group_map(params, "digests", _digest)
                    if "digest_key" in params and not params.get("digests_at_owner")
                    else {}
                ),
                digest_algo=_algo(params),
                digests_at_owner=_flag(params, "digests_at_owner"),
            )
        except (TypeError, ValueError) as exc:
            raise WireError(f"kv_transfer_params: {exc}") from None
        if out.tp_size > MAX_TP_SIZE:
            raise WireError(f"kv_transfer_params: 'tp_size' {out.tp_size} is above {MAX_TP_SIZE}")
        need_blocks = -(-out.num_tokens // block_size)
        got = len(out.block_ids.get(KVGroup.SELF, ()))
        if got != need_blocks:
            raise WireError(
                f"kv_transfer_params: {out.num_tokens} tokens need {need_blocks} blocks of "
                f"{block_size}, got {got} block ids"
            )
        if len(out.block_hashes.get(KVGroup.SELF, ())) != out.num_tokens // block_size:
            raise WireError("kv_transfer_params: one hash per full block expected")
        for group in set(out.block_ids) | set(out.block_hashes):
            if group == KVGroup.SELF:
                continue
            ids, hashes = out.block_ids.get(group, ()), out.block_hashes.get(group, ())
            if len(ids) != len(hashes):
                raise WireError(
                    f"kv_transfer_params: {group!r} needs one hash per block id, got "
                    f"{len(ids)} ids and {len(hashes)} hashes"
                )
            if group != KVGroup.CROSS and len(ids) > need_blocks:
                raise WireError(
                    f"kv_transfer_params: {group!r} lists {len(ids)} blocks, more than the "
                    f"{need_blocks} of {out.num_tokens} tokens"
                )
        for group, digests in out.digests.items():
            if len(digests) != len(out.block_ids.get(group, ())):
                raise WireError(
                    f"kv_transfer_params: 'digests' needs one digest per {group!r} block id"
                )
        return out


def _key(params: Mapping[str, Any]) -> int:
    value = params.get("digest_key")
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise WireError("kv_transfer_params: 'digest_key' must be an integer in [0, 2**64)")
    return value


def _algo(params: Mapping[str, Any]) -> str:
    value = params.get("digest_algo", ALGO_XXH3)
    if value not in DIGEST_ALGOS:
        raise WireError(f"kv_transfer_params: 'digest_algo' must be one of {DIGEST_ALGOS}")
    return str(value)


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise WireError(f"kv_transfer_params: {key!r} must be true or false")
    return value


def _digest(value: object) -> bytes:
    if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
        raise WireError(f"kv_transfer_params: a block digest must be {DIGEST_BYTES} bytes")
    return value


def _str(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_STR:
        raise WireError(f"kv_transfer_params: {key!r} must be a non-empty string")
    return value


def _int(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise WireError(f"kv_transfer_params: {key!r} must be a positive integer, got {value!r}")
    return value


def _num(params: Mapping[str, Any], key: str) -> float:
    value = params.get(key)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not (math.isfinite(value) and value > 0)
    ):
        raise WireError(
            f"kv_transfer_params: {key!r} must be a finite positive number, got {value!r}"
        )
    return float(value)


def _block_id(value: object) -> BlockId:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WireError(f"kv_transfer_params: block id {value!r} is not a non-negative integer")
    return BlockId(value)


def _hash(value: object) -> BlockHash:
    if not isinstance(value, bytes) or not 8 <= len(value) <= 64:
        raise WireError("kv_transfer_params: a block hash must be 8..64 bytes")
    return BlockHash(value)


def _group_map(params: Mapping[str, Any], key: str, item: Any) -> dict[KVGroup, tuple[Any, ...]]:
    value = params.get(key)
    if not isinstance(value, Mapping) or not 0 < len(value) <= 2 + MAX_ATTENTION_GROUPS:
        raise WireError(f"kv_transfer_params: {key!r} must map group names to lists")
    out: dict[KVGroup, tuple[Any, ...]] = {}
    for name, items in value.items():
        if name not in tuple(KVGroup) or not isinstance(items, list | tuple):
            raise WireError(f"kv_transfer_params: {key!r} has a bad group {name!r}")
        if len(items) > MAX_BLOCKS_PER_REQUEST:
            raise WireError(f"kv_transfer_params: {key!r} lists {len(items)} items, too many")
        out[KVGroup(name)] = tuple(item(x) for x in items)
    return out

"""What a decode's load is checked against: its prompt's block names, the seal it expects,
and whether prefill's cross blocks are this request's. Pure functions of the request and
prefill's answer, used by the planner (:mod:`kvbridge.connector.planner`) only."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvbridge.connector.base import RequestView
from kvbridge.connector.control.seal import seal_digest
from kvbridge.connector.handover import tail_name
from kvbridge.connector.params import KVTransferParams
from kvbridge.connector.windows import AttentionGroups
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId

__all__ = ["load_cross", "load_seal", "prompt_names"]

log = logging.getLogger("kvbridge.connector.planner")


def prompt_names(request: RequestView, num_tokens: int, block_size: int) -> tuple[BlockHash, ...]:
    """Names of the first ``num_tokens`` prompt tokens' ``self`` blocks of ``block_size``
    tokens, a partial last one included (the names a lease over exactly those blocks
    carries)."""
    full = num_tokens // block_size
    names = tuple(request.block_hashes.get(KVGroup.SELF, ())[:full])
    if num_tokens % block_size == 0:
        return names
    tail = request.prompt_token_ids[full * block_size : num_tokens]
    return (*names, tail_name(names, tail, request.encoder_hash))


def load_seal(request: RequestView, params: KVTransferParams, names: Sequence[BlockHash]) -> bytes:
    """The seal prefill's lease carries if its claimed ids hold this prompt's blocks
    (``names``: the prompt's names of the leased ``self`` blocks; each further group's names
    in ``params`` were checked to be this prompt's before)."""
    groups = {KVGroup.SELF: names}
    groups.update(AttentionGroups.names_of(params))
    if KVGroup.CROSS in params.block_ids:
        groups[KVGroup.CROSS] = tuple(request.block_hashes.get(KVGroup.CROSS, ()))
    return seal_digest(params.block_ids, groups)


def load_cross(
    request: RequestView,
    block_ids: Mapping[KVGroup, Sequence[BlockId]],
    params: KVTransferParams,
) -> bool:
    """Whether to load prefill's cross blocks: the engine needs them and they are the
    blocks of this request's encoder input."""
    wanted = tuple(block_ids.get(KVGroup.CROSS, ()))
    theirs = params.block_hashes.get(KVGroup.CROSS, ())
    mine = tuple(request.block_hashes.get(KVGroup.CROSS, ()))
    if wanted and (theirs != mine or len(theirs) != len(wanted)):
        why = "prefill's cross blocks are not this encoder input's; computing them here"
        log.info("request %s: %s", request.request_id, why)
        return False
    return bool(wanted)

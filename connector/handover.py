"""What a prefill hands over: the lease seam and the name of a prompt's partial last block.

:class:`LeaseIssuer` is implemented by whoever owns an engine's blocks and called by the
planner (:mod:`kvbridge.connector.planner`) when a prefill request finishes;
:func:`tail_name` is computed alike by prefill and decode from their own prompts.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvbridge.connector.control.leases import GroupBlocks, GroupHashes
from kvbridge.kernels.digest import ALGO_XXH3
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, LeaseId, RequestId

__all__ = ["LeaseIssuer", "group_name", "tail_name"]


class LeaseIssuer(ABC):
    """Puts a finished prefill request's blocks under a lease that a decode peer releases.

    Implemented by whoever owns the engine's blocks: kvbridge's serving node
    (:class:`kvbridge.worker.serving.engine_owner.EngineBlockOwner`, pins at once) and
    vLLM's adapter (:class:`kvbridge.connector.vllm.scheduler.HoldIssuer`, orders the
    worker to hold them). Called from the scheduler thread.
    """

    @abstractmethod
    def verified_prefix(
        self, group: KVGroup, block_ids: Sequence[BlockId], hashes: Sequence[BlockHash]
    ) -> int:
        """How many leading ``block_ids`` hold exactly the KV named by ``hashes``."""

    @abstractmethod
    def lease_request(
        self, request_id: RequestId, blocks: GroupBlocks, hashes: GroupHashes
    ) -> tuple[LeaseId, float]:
        """Take a reference on ``blocks`` and put it under a new lease: ``(lease_id, ttl_s)``."""

    digests_at_owner = False
    """True: :meth:`digests` only passes ``key`` on to where the KV lives (vLLM's worker),
    which digests the blocks when it makes the lease and answers the reader's ``Digests``
    call; the kv_transfer_params then carry the key and ``digests_at_owner``."""

    def digest_algo(self) -> str:
        """The algorithm :meth:`digests` uses (it travels in the params as ``digest_algo``, so
        a reader on another device computes the same one)."""
        return ALGO_XXH3

    def digests(self, blocks: GroupBlocks, key: int) -> dict[KVGroup, list[bytes]] | None:
        """Each leased block's :func:`~kvbridge.kernels.block_digests` under ``key``, for the
        kv_transfer_params; None: not digested (the hand-over goes unverified). With
        :attr:`digests_at_owner`: ``{}`` once the key is on its way to the owner."""
        return None


def tail_name(
    full_names: Sequence[BlockHash], tail: Sequence[int], encoder_hash: bytes | None = None
) -> BlockHash:
    """The name of a prompt's partial last block (full blocks are named by the hasher).

    Chained from the last full block's name (or, for a prompt shorter than one
    block, from the encoder input), so prefill and decode compute it alike from
    their own prompts: an owner's lease that names a tail other than this
    prompt's is refused, never read.
    """
    parent = full_names[-1] if full_names else b"\0" + (encoder_hash or b"")
    body = b"".join(int(t).to_bytes(4, "little") for t in tail)
    return BlockHash(hashlib.sha256(b"kvbridge-tail-v1\0" + parent + body).digest())


def group_name(group: str, name: BlockHash) -> BlockHash:
    """The name of a further attention group's block (a hybrid model's ``g<i>``) at the
    prompt position whose ``self`` block is named ``name``: the same tokens, another group's
    KV, so another name (a lease never confuses the two groups' blocks). A group block that
    covers several ``self`` blocks takes the name of the last of them
    (:meth:`kvbridge.connector.windows.AttentionGroups.names`)."""
    return BlockHash(
        hashlib.sha256(b"kvbridge-group-v1\0" + group.encode() + b"\0" + name).digest()
    )

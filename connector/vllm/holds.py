"""What holds a finished prefill request's blocks in a vLLM worker, as the control plane sees it.

:class:`HeldRequests` is the block owner behind the worker's lease table: the blocks vLLM
keeps (``delay_free``) for finished requests. The table itself is a plain
:class:`~kvbridge.connector.control.leases.LeaseTable`: each lease is made under the id the
scheduler chose and keeps the block digests the worker recorded at hand-over (in this
process's memory, never in NIXL-registered memory; decode asks for them with ``Digests``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from kvbridge.connector.control.leases import BlockOwner
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, RequestId

__all__ = ["HeldRequests"]

log = logging.getLogger(__name__)


class HeldRequests(BlockOwner):
    """The KV memory as the control plane sees it: blocks vLLM holds for finished requests.

    Thread-safe (the control server's threads and the lease reaper call
    :meth:`unpin`). A request is *done* once its lease is gone; vLLM then frees
    its blocks, which may be reused at once, so :meth:`pin_hashes` never pins
    anything: a decode that lost its lease recomputes.
    """

    def __init__(self, blocks_per_group: Mapping[str, int] | None = None) -> None:
        """``blocks_per_group``: the registered KV cache's blocks (none before registration)."""
        self.blocks_per_group: Mapping[str, int] = dict(blocks_per_group or {})
        self._lock = threading.Lock()
        self._held: dict[tuple[BlockId, ...], list[RequestId]] = {}
        self._done: set[RequestId] = set()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._held.values())

    def hold(self, request_id: RequestId, block_ids: Sequence[BlockId]) -> None:
        with self._lock:
            self._held.setdefault(tuple(block_ids), []).append(request_id)

    def release(self, request_id: RequestId) -> None:
        """Give a request back to vLLM without a lease (it could not be leased)."""
        with self._lock:
            for key, rids in list(self._held.items()):
                if request_id in rids:
                    rids.remove(request_id)
                    if not rids:
                        del self._held[key]
            self._done.add(request_id)

    def take_done(self) -> set[RequestId]:
        with self._lock:
            done, self._done = self._done, set()
        return done

    # ----- BlockOwner ----------------------------------------------------------------------
    def num_blocks(self, group: KVGroup) -> int:
        return self.blocks_per_group.get(group, 0)

    def pin_hashes(
        self, group_hashes: Mapping[KVGroup, Sequence[BlockHash]]
    ) -> dict[KVGroup, list[BlockId]]:
        return {g: [] for g in group_hashes}

    def unpin(self, blocks: Mapping[KVGroup, Sequence[BlockId]]) -> None:
        key = tuple(blocks.get(KVGroup.SELF, ()))
        with self._lock:
            rids = self._held.get(key)
            if not rids:
                log.warning("unpin of %d blocks that no request holds", len(key))
                return
            rid = rids.pop(0)
            if not rids:
                del self._held[key]
            self._done.add(rid)

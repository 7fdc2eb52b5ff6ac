"""A load's blocks shared between the CPU offload daemon and a remote engine.

A :class:`~kvbridge.connector.base.BlockLoad` lists every block it fills (``local_ids``,
per group) and, with a remote engine, where each sits in that engine's lease. Its first
``len(offload_hashes)`` ``self`` blocks and, for a hybrid model, the first
``len(offload_groups[g])`` blocks of each further group ``g`` are tried from the daemon
first (the planner put them there: :mod:`kvbridge.connector.windows`); what the daemon did
not give comes from the remote engine. Used by the worker half
(:mod:`kvbridge.connector.worker_side`).
"""

from __future__ import annotations

from dataclasses import replace

from kvbridge.connector.base import BlockLoad
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId

__all__ = ["daemon_blocks", "skip_offloaded"]


def daemon_blocks(load: BlockLoad) -> tuple[list[BlockId], list[BlockHash]]:
    """The blocks ``load`` tries from the daemon and their names: its ``self`` blocks, then
    each further group's, group after group."""
    ids = list(load.local_ids.get(KVGroup.SELF, ()))[: len(load.offload_hashes)]
    names = list(load.offload_hashes)
    for g, hashes in load.offload_groups.items():
        ids.extend(list(load.local_ids[g])[: len(hashes)])
        names.extend(hashes)
    return ids, names


def skip_offloaded(load: BlockLoad, n: int, groups: bool = False) -> BlockLoad:
    """``load`` for the remote engine alone: without its first ``n`` ``self`` blocks and, if
    ``groups``, each further group's daemon blocks (they came from the daemon). The rest
    keep their places in the owner's lease (``first_block``, ``lease_offsets``); a load
    that skips blocks no longer reads the whole lease."""
    cut = {KVGroup.SELF: n}
    if groups:
        cut.update({g: len(h) for g, h in load.offload_groups.items()})
    cut = {g: k for g, k in cut.items() if k > 0}
    if not cut:
        return load
    local, remote = dict(load.local_ids), dict(load.remote_ids)
    hashes, digests = dict(load.remote_hashes), dict(load.digests)
    offsets = dict(load.lease_offsets)
    for g, k in cut.items():
        local[g] = tuple(local.get(g, ()))[k:]
        remote[g] = tuple(remote.get(g, ()))[k:]
        hashes[g] = tuple(hashes.get(g, ()))[k:]
        if g in digests:
            digests[g] = tuple(digests[g])[k:]
        if g != KVGroup.SELF:
            offsets[g] = load.lease_offset(g) + k
    return replace(
        load,
        local_ids=local,
        remote_ids=remote,
        remote_hashes=hashes,
        digests=digests,
        lease_offsets=offsets,
        offload_hashes=(),
        offload_groups={},
        first_block=load.first_block + cut.get(KVGroup.SELF, 0),
        whole_lease=False,
    )

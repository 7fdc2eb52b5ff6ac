"""Bare NIXL calls on a kvbridge link: the "raw NIXL" side of same-run bench comparisons.

Used by ``bench transfer`` (its reader process) and ``bench offload`` (the worker side),
in the process that owns the :class:`~kvbridge.connector.transport.nixl.NixlTransport`.
:func:`bare_move` moves the same blocks as ``read_blocks``/``write_blocks`` would, on the
link's own prepped descriptor lists, with the descriptor indices computed before the
clock starts, through ``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state``: what a
program that calls NIXL by hand does, with none of kvbridge's checks, deadline or handle.
It reads the transport's internals (its agent, lock and link tables) on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvbridge.connector.transport.base import PeerLink
from kvbridge.connector.transport.nixl_descs import request_indices
from kvbridge.proto.errors import TransferError
from kvbridge.proto.layout import KVGroup
from kvbridge.proto.negotiate import TransferMode

__all__ = ["bare_move"]


def bare_move(
    transport: Any,
    link: PeerLink,
    op: str,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    group: KVGroup = KVGroup.SELF,
) -> float:
    """Seconds one bare NIXL READ or WRITE (``op``: ``read``/``write``) of these blocks takes."""
    state = transport._links[link.link_id]
    local_h, remote_h = state.dlists[group]
    agent = transport._nixl._agent
    li, ri = request_indices(
        link.local.layout,
        link.remote_layout,
        group,
        local_ids,
        remote_ids,
        per_span=link.mode is TransferMode.PER_SPAN,
        strided=state.strided,
    )
    t0 = time.perf_counter()
    with transport._lock:
        xfer = agent.make_prepped_xfer(op.upper(), local_h, li, remote_h, ri, b"")
        try:
            status = agent.transfer(xfer)
            while status == "PROC":
                status = agent.check_xfer_state(xfer)
        finally:
            xfer.release()
    elapsed = time.perf_counter() - t0
    if status != "DONE":
        raise TransferError(f"bare NIXL {op} ended {status}")
    return elapsed

"""The worker half of kvbridge inside vLLM: where the KV memory lives, and what holds it.

Runs in each vLLM worker process (the model runner). It imports no vLLM; the
adapter (:mod:`kvbridge.connector.vllm`) hands it plain tensors, step plans and
request ids. When vLLM registers its KV caches it builds the process's
:class:`~kvbridge.connector.engine_side.EngineSide` (the same assembly as
kvbridge's own serving node; NIXL and gRPC load only then):

- one :class:`~kvbridge.connector.transport.nixl.NixlTransport` for the process;
- decode: :class:`~kvbridge.connector.worker_side.KVBridgeWorker` runs each
  step's :class:`~kvbridge.connector.base.BlockLoad` (READ under a deadline,
  fail closed, release the prefill's lease);
- prefill: a control server with a lease table over :class:`HeldRequests`.
  vLLM holds a finished request's blocks (``delay_free``); a lease says a
  decode peer may read them; when the lease is released or expires the
  request is reported in ``done_sending`` and vLLM frees the blocks;
- with an offload daemon: ``KVBridgeWorker`` also loads blocks from it and
  stores finished requests' blocks into it. A request held for a decode peer
  *and* being stored is reported in ``done_sending`` once, when both are over
  (:class:`_Sends`).

The scheduler picks each lease's id (it must put it into
``kv_transfer_params`` before the worker hears of the request); the worker makes
the lease under that id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.connector.base import StepMetadata
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.leases import HandOverDigests
from kvbridge.connector.vllm.holds import HeldRequests
from kvbridge.connector.vllm.scheduler import HoldOrder
from kvbridge.connector.vllm.stats import TransferStats
from kvbridge.proto.errors import ConfigError, KVBridgeError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.types import BlockId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.base import LoadResult
    from kvbridge.connector.control.leases import LeaseTable
    from kvbridge.connector.control.server import ControlServer
    from kvbridge.connector.engine_side import EngineSide
    from kvbridge.connector.server_options import ServerOptions
    from kvbridge.connector.transport.nixl import NixlTransport
    from kvbridge.connector.worker_side import KVBridgeWorker

__all__ = ["VllmWorker", "WorkerSettings", "HeldRequests"]

log = logging.getLogger(__name__)

RESULTS_KEPT = 1024
"""Load reports :attr:`VllmWorker.results` keeps (the newest; older ones are dropped)."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What the worker half needs beyond :class:`ConnectorConfig` (built by the adapter).

    With tensor parallelism every rank runs its own kvbridge worker (NIXL agent, control
    server, lease and seal tables) over its slice of the KV heads; a producer's rank ``r``
    serves control at ``control_port + r`` (``peers.rank_port``) and a reader's rank ``r``
    dials the peer's rank ``r`` only.
    """

    model_name: str
    block_size: int
    control_host: str = "127.0.0.1"
    control_port: int = 0
    """Rank 0's control port (0 on a consumer: it serves none)."""
    tp_rank: int = 0
    tp_size: int = 1
    tls_cert: bytes | None = None
    """PEM certificate chain of the control server (with ``tls_key``): TLS only."""
    tls_key: bytes | None = None

    def __post_init__(self) -> None:
        from kvbridge.connector.control.peers import rank_port

        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.control_port:  # every rank's port must exist
            rank_port(self.control_port, self.tp_size - 1)
        _ = self.control_listen(None)  # building it checks the port and the TLS pair

    def control_listen(self, token: str | None) -> ServerOptions:
        """This rank's control port (``control_port + tp_rank``; 0: any free one)."""
        from kvbridge.connector.control.peers import rank_port
        from kvbridge.connector.server_options import ServerOptions

        port = rank_port(self.control_port, self.tp_rank) if self.control_port else 0
        return ServerOptions(
            self.control_host, port, token, self.tls_cert, self.tls_key, port_knob="control_port"
        )


class VllmWorker:
    """kvbridge in one vLLM worker process; ``close()`` stops everything it started."""

    def __init__(self, config: ConnectorConfig, settings: WorkerSettings) -> None:
        self.config = config
        self.settings = settings
        self.layout: KVLayout | None = None
        self.side: EngineSide | None = None
        """kvbridge's side of this process (transport, loader, leases, control server),
        built when vLLM registers its KV caches; the attributes below name its parts."""
        self.transport: NixlTransport | None = None
        self.loader: KVBridgeWorker | None = None
        self.held = HeldRequests()
        self.leases: LeaseTable | None = None
        self.control: ControlServer | None = None
        self.results: dict[RequestId, LoadResult] = {}
        """The newest :data:`RESULTS_KEPT` load reports, oldest first, for stats; vLLM itself
        never reads them, so a long-running worker keeps a window, not every request."""
        self.stats = TransferStats()
        """Loads since vLLM last collected them (``get_kv_connector_stats``, every step)."""
        self._sends = _Sends()
        self._failed: set[RequestId] = set()

    # ----- start-up ------------------------------------------------------------------------
    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        model_suffix: str = "",
        layer_groups: Mapping[str, KVGroup] | None = None,
    ) -> KVLayout:
        """Describe and register vLLM's per-layer views of logical shape (2, B, N, H, C);
        ``model_suffix`` tags the model name with how the views were cut from vLLM's pages
        (``views.packed_suffix``), so only peers with the same pages negotiate;
        ``layer_groups``: each layer's kvbridge group (a hybrid model's; default ``self``)."""
        from kvbridge.connector.engine_side import EngineSide

        s = self.settings
        layout = KVLayout.from_tensors(
            kv_caches,
            model_name=s.model_name + model_suffix,
            block_size=s.block_size,
            layer_groups=layer_groups,
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
        )
        produces = self.config.produces
        side = EngineSide(
            self.config,
            control=s.control_listen(self.config.token) if produces else None,
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
        )
        self.side, self.transport, self.loader = side, side.transport, side.loader
        side.loader.register_kv_caches(kv_caches, layout)
        self.layout = side.layout
        if produces:
            self.held = HeldRequests({g.name: g.num_blocks for g in layout.groups})
            self.leases = side.serve(self.held)
            self.control = side.control
        log.info("kvbridge registered vLLM's KV cache: %s", self.layout.describe())
        return self.layout

    # ----- per step ------------------------------------------------------------------------
    def start_step(self, step: StepMetadata, holds: Sequence[HoldOrder]) -> None:
        """Put finished prefill requests under leases, then start this step's loads and
        offload stores."""
        self._sends.expect([o.request_id for o in holds] + [s.request_id for s in step.stores])
        for order in holds:
            self._hold(order)
        if (step.loads or step.stores) and self.loader is not None:
            self.loader.start_load_kv(step)

    def _hold(self, order: HoldOrder) -> None:
        if self.leases is None:  # not a producer: the scheduler never orders holds
            log.warning("request %s: hold order on a non-producer; ignored", order.request_id)
            self.held.release(order.request_id)  # vLLM may free the blocks at once
            return
        self.held.hold(order.request_id, order.block_ids)
        try:
            self.leases.create(
                order.blocks(),
                ttl_s=order.ttl_s,
                hashes=order.hashes(),
                request_id=order.request_id,
                lease_id=order.lease_id,
                digests=self._digests(order),
                seal_key=order.digest_key,
            )
        except Exception as exc:  # e.g. the table is full: decode recomputes, vLLM frees
            log.warning("request %s: could not lease its blocks (%s)", order.request_id, exc)
            self.held.release(order.request_id)

    def _digests(self, order: HoldOrder) -> HandOverDigests | None:
        """The held blocks' digests under the order's key (None: no key, or they could not
        be digested: a reader that asks then recomputes). Kept in this process only.

        Pages a reader of a bigger TP size can read in head slices are also digested head
        by head (XXH3 over CPU memory only: a device writer records none, and such a
        reader recomputes)."""
        if order.digest_key is None or self.layout is None:
            return None
        from kvbridge.kernels import (
            ALGO_XXH3,
            block_digests,
            digest_algo,
            head_digest_parts,
            page_slice_digests,
        )

        layout, key = self.layout, order.digest_key
        algo = digest_algo(layout, KVGroup.SELF)
        blocks = order.blocks()
        try:
            got = {g: tuple(block_digests(layout, g, list(b), key)) for g, b in blocks.items()}
            heads = head_digest_parts(layout) if algo == ALGO_XXH3 else 0
            # every group's blocks (a hybrid model's sliding-window groups too): a reader of
            # a bigger TP size checks each group's head slices
            per_head = {
                g: tuple(
                    d for block in page_slice_digests(layout, g, list(b), key, heads) for d in block
                )
                for g, b in (blocks.items() if heads else ())
            }
        except KVBridgeError as exc:
            log.warning("request %s: no block digests (%s)", order.request_id, exc)
            return None
        return HandOverDigests(algo, got, heads, per_head)

    def get_finished(self) -> tuple[set[RequestId], set[RequestId]]:
        """``(done_sending, done_receiving)`` since the last call."""
        released = self.held.take_done()
        stored: set[RequestId] = set()
        receiving: set[RequestId] = set()
        if self.loader is not None:
            stored, receiving = self.loader.get_finished(set())
            for rid in receiving:
                result = self.loader.pop_result(rid)
                if result is not None:
                    self._keep_result(rid, result)
                    self.stats.record(result)
                    if result.bad_block_ids:
                        self._failed.add(rid)
        return self._sends.done([*released, *stored]), receiving

    def _keep_result(self, rid: RequestId, result: LoadResult) -> None:
        self.results.pop(rid, None)  # a reused request id moves to the newest end
        self.results[rid] = result
        while len(self.results) > RESULTS_KEPT:
            del self.results[next(iter(self.results))]

    @property
    def pending_sends(self) -> int:
        """Finished requests whose blocks are still held for a decode peer or a store."""
        return len(self._sends)

    def take_failed(self) -> set[RequestId]:
        """Requests reported in ``get_finished`` whose load left blocks to recompute, since
        the last call (a hybrid model's engine recomputes such a request whole)."""
        failed, self._failed = self._failed, set()
        return failed

    def load_errors(self) -> set[BlockId]:
        return set() if self.loader is None else self.loader.get_block_ids_with_load_errors()

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
        self.side = self.control = self.loader = self.transport = None


class _Sends:
    """Requests whose blocks vLLM keeps (``delay_free``) until every use of them is over:
    a lease for a decode peer, a store into the offload daemon, or both."""

    def __init__(self) -> None:
        self._open: dict[RequestId, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def expect(self, request_ids: Iterable[RequestId]) -> None:
        for rid in request_ids:
            self._open[rid] = self._open.get(rid, 0) + 1

    def done(self, request_ids: Iterable[RequestId]) -> set[RequestId]:
        """Count ``request_ids``' uses as over; the requests with none left."""
        finished: set[RequestId] = set()
        for rid in request_ids:
            left = self._open.get(rid, 0) - 1
            if left > 0:
                self._open[rid] = left
                continue
            if left < 0:
                log.warning("request %s: a use of its blocks ended that was never begun", rid)
            self._open.pop(rid, None)
            finished.add(rid)
        return finished

"""The worker half of kvbridge inside vLLM: where the KV memory lives, and what holds it.

Runs in each vLLM worker process (the model runner). It imports no vLLM; the
adapter (:mod:`kvbridge.connector.vllm`) hands it plain tensors, step plans and
request ids. It is the composition root of kvbridge inside vLLM (the way
:class:`kvbridge.worker.serving.node.Node` is for kvbridge's own engine), so it wires
pieces from ``kvbridge.worker`` (NIXL and gRPC load only when the caches are
registered):

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
``kv_transfer_params`` before the worker hears of the request), so the lease
table here answers to that id: :class:`_NamedLeases` maps it to the table's
own id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.connector.base import StepMetadata
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.leases import HandOverDigests
from kvbridge.connector.control.types import PeerInfo, Role
from kvbridge.connector.vllm.holds import HeldRequests, NamedLeases
from kvbridge.connector.vllm.scheduler import HoldOrder
from kvbridge.connector.vllm.stats import TransferStats
from kvbridge.proto.errors import ConfigError, KVBridgeError
from kvbridge.proto.layout import KVGroup, KVLayout
from kvbridge.proto.types import BlockId, EngineId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.base import LoadResult
    from kvbridge.connector.control.client import ControlClient
    from kvbridge.connector.control.server import ControlServer
    from kvbridge.connector.transport.nixl import NixlTransport
    from kvbridge.connector.worker_side import KVBridgeWorker

__all__ = ["VllmWorker", "WorkerSettings", "HeldRequests", "NamedLeases"]

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


class VllmWorker:
    """kvbridge in one vLLM worker process; ``close()`` stops everything it started."""

    def __init__(self, config: ConnectorConfig, settings: WorkerSettings) -> None:
        self.config = config
        self.settings = settings
        self.layout: KVLayout | None = None
        self.transport: NixlTransport | None = None
        self.loader: KVBridgeWorker | None = None
        self.held = HeldRequests()
        self.leases: NamedLeases | None = None
        self.control: ControlServer | None = None
        self.results: dict[RequestId, LoadResult] = {}
        """The newest :data:`RESULTS_KEPT` load reports, oldest first, for stats; vLLM itself
        never reads them, so a long-running worker keeps a window, not every request."""
        self.stats = TransferStats()
        """Loads since vLLM last collected them (``get_kv_connector_stats``, every step)."""
        self._sends = _Sends()

    # ----- start-up ------------------------------------------------------------------------
    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Mapping[str, KVGroup] | None = None,
    ) -> KVLayout:
        """Describe and register vLLM's per-layer views of logical shape (2, B, N, H, C);
        ``layer_groups``: each layer's kvbridge group (a hybrid model's; default ``self``)."""
        from kvbridge.connector.control.peers import nixl_agent_name, rank_port
        from kvbridge.connector.control.server import ControlServerConfig, serve
        from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport
        from kvbridge.connector.worker_side import KVBridgeWorker

        s = self.settings
        layout = KVLayout.from_tensors(
            kv_caches,
            model_name=s.model_name,
            block_size=s.block_size,
            layer_groups=layer_groups,
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
        )
        # one agent name per rank: a reader of several ranks loads them all (heterogeneous TP)
        agent = nixl_agent_name(self.config.engine_id, s.tp_rank, s.tp_size)
        self.transport = NixlTransport(NixlConfig(name=agent))
        self.loader = KVBridgeWorker(self.config, self.transport, self._client, self._peer_info)
        self.loader.register_kv_caches(kv_caches, layout)
        assert self.loader.memory is not None
        self.layout = self.loader.memory.layout
        if self.config.produces:
            self.held.blocks_per_group = {g.name: g.num_blocks for g in layout.groups}
            self.leases = NamedLeases(self.held, self.loader.seal)
            self.loader.listen_for_releases(self.leases.release)
            self.control = serve(
                self._peer_info(self.layout),
                self.leases,
                ControlServerConfig(
                    host=s.control_host,
                    port=rank_port(s.control_port, s.tp_rank) if s.control_port else 0,
                    token=self.config.token,
                    tls_cert=s.tls_cert,
                    tls_key=s.tls_key,
                    default_ttl_s=self.config.lease_ttl_s,
                    max_ttl_s=self.config.max_lease_ttl_s,
                ),
            )
        log.info("kvbridge registered vLLM's KV cache: %s", self.layout.describe())
        return self.layout

    def _peer_info(self, layout: KVLayout) -> PeerInfo:
        assert self.transport is not None
        return PeerInfo(
            engine_id=EngineId(self.config.engine_id),
            role=Role(self.config.role),
            layout=layout,
            agent_metadata=self.transport.metadata(),
            control_address=self._own_address(),
            seal_layout=None if self.loader is None else self.loader.seal_layout,
        )

    def _own_address(self) -> str:
        """This rank's control address (the advertised one is rank 0's)."""
        from kvbridge.connector.control.peers import rank_address

        address, rank = self.config.control_address, self.settings.tp_rank
        return rank_address(address, rank) if address and rank else address

    def _client(self, address: str, tp_rank: int) -> ControlClient:
        from kvbridge.connector.control.peers import dial_control

        # an address from kv_transfer_params is a claim: dial only peers the operator allowed
        # (rank 0's address is checked); the remote rank's port is derived from it, never
        # read (the loader picks the rank from both TP sizes)
        return dial_control(address, self.config, tp_rank)

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
            self.leases.create_named(order, self._digests(order))
        except Exception as exc:  # e.g. the table is full: decode recomputes, vLLM frees
            log.warning("request %s: could not lease its blocks (%s)", order.request_id, exc)
            self.held.release(order.request_id)

    def _digests(self, order: HoldOrder) -> HandOverDigests | None:
        """The held blocks' digests under the order's key (None: no key, or they could not
        be digested: a reader that asks then recomputes). Kept in this process only."""
        if order.digest_key is None or self.layout is None:
            return None
        from kvbridge.kernels import block_digests, digest_algo

        got: dict[KVGroup, tuple[bytes, ...]] = {}
        try:
            for group, ids in order.blocks().items():
                got[group] = tuple(block_digests(self.layout, group, list(ids), order.digest_key))
        except KVBridgeError as exc:
            log.warning("request %s: no block digests (%s)", order.request_id, exc)
            return None
        return HandOverDigests(digest_algo(self.layout, KVGroup.SELF), got)

    def get_finished(self) -> tuple[set[RequestId], set[RequestId]]:
        """``(done_sending, done_receiving)`` since the last call."""
        released = self.held.take_done()
        if self.leases is not None:
            self.leases.forget(released)
        stored: set[RequestId] = set()
        receiving: set[RequestId] = set()
        if self.loader is not None:
            stored, receiving = self.loader.get_finished(set())
            for rid in receiving:
                result = self.loader.pop_result(rid)
                if result is not None:
                    self._keep_result(rid, result)
                    self.stats.record(result)
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

    def load_errors(self) -> set[BlockId]:
        return set() if self.loader is None else self.loader.get_block_ids_with_load_errors()

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.loader is not None:
            self.loader.close()
        if self.transport is not None:
            self.transport.close()
        self.control = self.loader = self.transport = None


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

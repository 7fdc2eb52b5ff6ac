"""A serving node: one reference engine with kvbridge's connector, control and request APIs.

``kvbridge serve --role prefill|decode|both`` runs one :class:`Node`:

- the :class:`~kvbridge.worker.engine.Engine` stepping on its own thread,
- kvbridge's connector halves around it (NIXL transport, control clients),
- a ``PeerControl`` server (handshake, pins, leases) for peers that read our KV,
- an ``Inference`` server that the router sends requests to.

Requests cross from gRPC threads to the engine thread through a queue; the
engine is only ever touched by its own thread (and its pools under its lock).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.client import ControlClient
from kvbridge.connector.control.peers import dial_control
from kvbridge.connector.control.server import ControlServer, ControlServerConfig, serve
from kvbridge.connector.control.types import PeerInfo, Role
from kvbridge.connector.events import MEDIUM_GPU, KVEventsConfig, ZmqEventPublisher
from kvbridge.connector.offload.lookup import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.planner import KVBridgePlanner
from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport
from kvbridge.connector.worker_side import KVBridgeWorker
from kvbridge.proto import engine_pb2 as epb
from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import ConfigError, KVBridgeError
from kvbridge.proto.layout import KVLayout
from kvbridge.proto.types import EngineId, RequestId
from kvbridge.worker.engine import Engine, EngineConfig, RequestOutput
from kvbridge.worker.kv_events import open_sink
from kvbridge.worker.serving.engine_owner import EngineBlockOwner
from kvbridge.worker.serving.inference import (
    GenerateResult,
    InferenceServicer,
    inference_server,
    listen,
)
from kvbridge.worker.serving.metrics import NodeMetrics

__all__ = ["NodeConfig", "Node"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything one serving process needs, validated at the edge (the CLI)."""

    engine: EngineConfig
    connector: ConnectorConfig
    host: str = "127.0.0.1"
    port: int = 0
    """Inference API port (0: pick a free one)."""
    control_port: int = 0
    request_timeout_s: float = 120.0
    tls_cert: bytes | None = None
    """PEM certificate both servers (Inference, control) present; with ``tls_key``."""
    tls_key: bytes | None = None
    max_connection_idle_s: float = 300.0
    """The Inference server closes connections idle this long."""
    max_concurrent_requests: int = 64
    """Inference calls in flight at once; more are refused RESOURCE_EXHAUSTED."""
    kv_events: KVEventsConfig | None = None
    """Publish the prefix cache's KV events (medium GPU) with these settings."""
    device: str = "cpu"
    """torch device of the engine's model and KV cache (``cpu``, ``cuda``, ``cuda:N``)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device {self.device!r} must be cpu, cuda or cuda:N")
        for knob in ("port", "control_port"):
            if not 0 <= getattr(self, knob) <= 65535:
                raise ConfigError(f"{knob} {getattr(self, knob)} is outside 0..65535")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        if self.max_connection_idle_s <= 0:
            raise ConfigError(
                f"max_connection_idle_s must be > 0, got {self.max_connection_idle_s}"
            )
        if self.max_concurrent_requests < 1:
            raise ConfigError(
                f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}"
            )


@dataclass(slots=True)
class _Submission:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: dict[str, Any] | None
    encoder_input: bytes | None = None
    future: futures.Future[GenerateResult] = field(default_factory=futures.Future)


class Node(Closing):
    """One engine with its connector and servers; ``close()`` stops everything.

    Construction is all or nothing: if a step fails (a port taken, a bad
    layout), what the earlier steps built is closed in reverse order before the
    error propagates, so a failed ``Node(...)`` leaves no agent, server or thread.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        cc = config.connector
        with ExitStack() as built:
            self.transport = NixlTransport(NixlConfig(name=cc.engine_id))
            built.callback(self.transport.close)
            self.scheduler_connector = KVBridgePlanner(cc, config.engine.block_size)
            self.worker_connector = KVBridgeWorker(
                cc, self.transport, self._client, self._peer_info
            )
            built.callback(self.worker_connector.close)
            self.kv_events: ZmqEventPublisher | None = None
            events = None
            if config.kv_events is not None:
                self.kv_events, make_sink = open_sink(config.kv_events, MEDIUM_GPU, group_idx=0)
                built.callback(self.kv_events.close)
                events = make_sink(config.engine.block_size)
            self.engine = Engine(
                config.engine,
                connector_scheduler=self.scheduler_connector,
                connector_worker=self.worker_connector,
                events=events,
                device=config.device,
            )
            self.owner = EngineBlockOwner(self.engine, cc.lease_ttl_s, self.worker_connector.seal)
            self.worker_connector.listen_for_releases(self.owner.leases.release)
            self.metrics = NodeMetrics(lambda: len(self.owner.leases))
            # the scheduler asks the daemon on its own thread: a bounded lookup-only client
            # (as vLLM's scheduler uses): a hung daemon costs one short deadline, then a backoff
            self.offload_lookup = (
                OffloadLookup(OffloadLookupConfig(cc.offload_address, token=cc.token))
                if cc.offload_address
                else None
            )
            if self.offload_lookup is not None:
                built.callback(self.offload_lookup.close)
            self.scheduler_connector.attach(self.owner, self.offload_lookup)
            assert self.worker_connector.memory is not None
            self.layout = self.worker_connector.memory.layout
            self.control: ControlServer = serve(
                self._peer_info(self.layout),
                self.owner.leases,
                ControlServerConfig(
                    host=config.host,
                    port=config.control_port,
                    token=cc.token,
                    tls_cert=config.tls_cert,
                    tls_key=config.tls_key,
                    default_ttl_s=cc.lease_ttl_s,
                    max_ttl_s=cc.max_lease_ttl_s,
                ),
            )
            built.callback(self.control.close)
            # the address peers find us at goes into kv_transfer_params
            self.scheduler_connector.config = _with_address(cc, self.control.address)
            self._inbox: queue.Queue[_Submission] = queue.Queue()
            self._waiting: dict[RequestId, _Submission] = {}
            self._stop = threading.Event()
            self._wakeup = threading.Event()
            self._thread = threading.Thread(target=self._run, name="kvb-engine", daemon=True)
            self._thread.start()
            built.callback(self._stop_engine)
            self._grpc = inference_server(
                InferenceServicer(self, config.request_timeout_s),
                token=config.connector.token,
                max_connection_idle_s=config.max_connection_idle_s,
                max_concurrent_requests=config.max_concurrent_requests,
            )
            built.callback(lambda: self._grpc.stop(grace=0.5).wait())
            self.port = listen(
                self._grpc, config.host, config.port, config.tls_cert, config.tls_key
            )
            self._grpc.start()
            self._closer = built.pop_all()
        log.info(
            "%s (%s) serving requests on %s:%d%s, control on %s",
            cc.engine_id,
            cc.role,
            config.host,
            self.port,
            " with TLS" if config.tls_cert else "",
            self.control.address,
        )

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # ----- wiring --------------------------------------------------------------------------
    def _peer_info(self, layout: KVLayout) -> PeerInfo:
        cc = self.config.connector
        return PeerInfo(
            engine_id=EngineId(cc.engine_id),
            role=Role(cc.role),
            layout=layout,
            agent_metadata=self.transport.metadata(),
            seal_layout=self.worker_connector.seal_layout,
        )

    def _client(self, address: str, tp_rank: int = 0) -> ControlClient:
        # an address from kv_transfer_params is a claim: dial only peers the operator allowed
        return dial_control(address, self.config.connector, tp_rank)

    # ----- requests ------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
        request_id: str,
        encoder_input: bytes | None = None,
    ) -> futures.Future[GenerateResult]:
        sub = _Submission(request_id, prompt, max_tokens, params, encoder_input)
        self._inbox.put(sub)
        self._wakeup.set()
        return sub.future

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._admit()
            if not engine.has_unfinished() and not engine.has_held_blocks():
                self._wakeup.wait(0.05)  # idle: sleep until a request arrives
                self._wakeup.clear()
                continue
            before = engine.num_forwards
            try:
                outputs = engine.step()
            except Exception:  # never let a bug kill the loop silently: fail the requests
                log.exception("engine step failed")
                self._fail_all("engine step failed; see the server log")
                continue
            for out in outputs:
                if out.finished:
                    self._finish(out)
            if engine.num_forwards == before:
                time.sleep(0.0005)  # waiting on loads: do not spin a core

    def _admit(self) -> None:
        while True:
            try:
                sub = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                rid = self.engine.add_request(
                    sub.prompt, sub.max_tokens, sub.request_id, sub.params, sub.encoder_input
                )
            except KVBridgeError as exc:
                sub.future.set_exception(exc)
                continue
            self._waiting[rid] = sub

    def _finish(self, out: RequestOutput) -> None:
        sub = self._waiting.pop(out.request_id, None)
        load = self.worker_connector.pop_result(out.request_id)
        refused = self.scheduler_connector.refused.pop(out.request_id, None)
        self.metrics.observe(out, load)
        if sub is None:
            return
        result = GenerateResult(out)
        if refused is not None:
            result.load_error, result.blocks_refused = refused
        if load is not None:
            result.transfer_ms = load.transfer_ms
            result.blocks_moved = load.blocks_moved
            result.blocks_moved_by_group = {g.value: n for g, n in load.moved_by_group.items()}
            result.bytes_moved = load.bytes_moved
            result.blocks_offloaded = load.blocks_offloaded
            result.offload_bad_digest = load.offload_bad_digest
            result.load_error = load.error
            if load.error and self.config.connector.on_load_error == "fail":
                sub.future.set_exception(
                    KVBridgeError(
                        f"request {out.request_id}: KV load failed ({load.error}) "
                        "and --on-load-error is 'fail'"
                    )
                )
                return
        sub.future.set_result(result)

    def _fail_all(self, reason: str) -> None:
        for rid, sub in list(self._waiting.items()):
            self.engine.abort(rid)
            sub.future.set_exception(KVBridgeError(reason))
        self._waiting.clear()

    # ----- stats and lifecycle -------------------------------------------------------------
    def stats(self) -> epb.EngineStatsResponse:
        free = {g.value: self.engine.num_free_blocks(g) for g in self.engine.pools}
        total = {g.value: p.num_blocks for g, p in self.engine.pools.items()}
        return epb.EngineStatsResponse(
            engine_id=self.config.connector.engine_id,
            role=self.config.connector.role,
            free_blocks=free,
            total_blocks=total,
            active_leases=len(self.owner.leases),
            running_requests=len(self._waiting),
        )

    def close(self) -> None:
        """Stop the Inference server, the engine thread, the control server, the
        connector and the NIXL agent (the reverse of construction)."""
        self._closer.close()

    def _stop_engine(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._fail_all("server shutting down")


def _with_address(cc: ConnectorConfig, address: str) -> ConnectorConfig:
    from dataclasses import replace

    return replace(cc, control_address=cc.control_address or address)

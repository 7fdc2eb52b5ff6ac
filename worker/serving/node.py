"""A serving node: one reference engine with kvbridge's connector, control and request APIs.

``kvbridge serve --role prefill|decode|both`` runs one :class:`Node`:

- the :class:`~kvbridge.worker.engine.Engine` stepping on its own thread,
- kvbridge's engine side around it (:class:`~kvbridge.connector.engine_side.EngineSide`:
  NIXL transport, loader, lease table and a ``PeerControl`` server for peers that read
  our KV, built as in vLLM's worker) and the planner (the scheduler half),
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
from dataclasses import dataclass, field, replace
from typing import Any

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.grpc_server import bind
from kvbridge.connector.control.server import ControlServer
from kvbridge.connector.engine_side import EngineSide
from kvbridge.connector.events import MEDIUM_GPU, KVEventsConfig, ZmqEventPublisher
from kvbridge.connector.offload.lookup import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.planner import KVBridgePlanner
from kvbridge.connector.server_options import ServerOptions
from kvbridge.proto import engine_pb2 as epb
from kvbridge.proto.closing import Closing
from kvbridge.proto.errors import ConfigError, KVBridgeError
from kvbridge.proto.types import RequestId
from kvbridge.worker.engine import Engine, EngineConfig, RequestOutput
from kvbridge.worker.kv_events import open_sink
from kvbridge.worker.serving.engine_owner import EngineBlockOwner, EngineLeaseIssuer
from kvbridge.worker.serving.inference import GenerateResult, InferenceServicer, inference_server
from kvbridge.worker.serving.metrics import NodeMetrics

__all__ = ["NodeConfig", "Node"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything one serving process needs, validated at the edge (the CLI)."""

    engine: EngineConfig
    connector: ConnectorConfig
    listen: ServerOptions = field(default_factory=ServerOptions)
    """The Inference port (0: pick a free one), the token callers must send, and the TLS
    pair; the control server takes the same, on ``control_port``."""
    control_port: int = 0
    request_timeout_s: float = 120.0
    max_connection_idle_s: float = 300.0
    """The Inference server closes connections idle this long."""
    max_concurrent_requests: int = 64
    """Inference calls in flight at once; more are refused RESOURCE_EXHAUSTED."""
    kv_events: KVEventsConfig | None = None
    """Publish the prefix cache's KV events (medium GPU) with these settings."""
    device: str = "cpu"
    """torch device of the engine's model and KV cache (``cpu``, ``cuda``, ``cuda:N``)."""

    @property
    def control_listen(self) -> ServerOptions:
        """The control port: the Inference port's host, token and TLS on ``control_port``."""
        return replace(self.listen, port=self.control_port, port_knob="control_port")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device {self.device!r} must be cpu, cuda or cuda:N")
        _ = self.control_listen  # building it checks the control port
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
        with ExitStack() as built:
            # transport, loader, control port: the engine side, the same assembly as vLLM's
            self.side = EngineSide(config.connector, control=config.control_listen)
            built.callback(self.side.close)
            cc = self.side.config  # with the control address peers find us at
            self.transport = self.side.transport
            self.worker_connector = self.side.loader
            self.scheduler_connector = KVBridgePlanner(cc, config.engine.block_size)
            self.kv_events: ZmqEventPublisher | None = None
            events = None
            if config.kv_events is not None:
                self.kv_events, make_sink = open_sink(config.kv_events, MEDIUM_GPU, group_idx=0)
                built.callback(self.kv_events.close)
                events = make_sink(config.engine.block_size)
            self.engine = Engine(  # registers its KV cache with the loader
                config.engine,
                connector_scheduler=self.scheduler_connector,
                connector_worker=self.worker_connector,
                events=events,
                device=config.device,
            )
            self.leases = self.side.serve(EngineBlockOwner(self.engine))
            self.metrics = NodeMetrics(lambda: len(self.leases))
            # the scheduler asks the daemon on its own thread: a bounded lookup-only client
            # (as vLLM's scheduler uses): a hung daemon costs one short deadline, then a backoff
            self.offload_lookup = (
                OffloadLookup(OffloadLookupConfig(cc.offload_address, token=cc.token))
                if cc.offload_address
                else None
            )
            if self.offload_lookup is not None:
                built.callback(self.offload_lookup.close)
            issuer = EngineLeaseIssuer(self.engine, self.leases, cc.lease_ttl_s)
            self.scheduler_connector.attach(issuer, self.offload_lookup)
            self.layout = self.side.layout
            assert self.side.control is not None
            self.control: ControlServer = self.side.control
            self._inbox: queue.Queue[_Submission] = queue.Queue()
            self._waiting: dict[RequestId, _Submission] = {}
            self._stop = threading.Event()
            self._wakeup = threading.Event()
            self._thread = threading.Thread(target=self._run, name="kvb-engine", daemon=True)
            self._thread.start()
            built.callback(self._stop_engine)
            self._grpc = inference_server(
                InferenceServicer(self, config.request_timeout_s),
                options=config.listen,
                max_connection_idle_s=config.max_connection_idle_s,
                max_concurrent_requests=config.max_concurrent_requests,
            )
            built.callback(lambda: self._grpc.stop(grace=0.5).wait())
            self.port = bind(self._grpc, config.listen, "; pick another --port")
            self._grpc.start()
            self._closer = built.pop_all()
        log.info(
            "%s (%s) serving requests on %s:%d%s, control on %s",
            cc.engine_id,
            cc.role,
            config.listen.host,
            self.port,
            " with TLS" if config.listen.tls else "",
            self.control.address,
        )

    @property
    def address(self) -> str:
        return f"{self.config.listen.host}:{self.port}"

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
            active_leases=len(self.leases),
            running_requests=len(self._waiting),
        )

    def close(self) -> None:
        """Stop the Inference server, the engine thread, then the engine side (control
        server, connector, NIXL agent): the reverse of construction."""
        self._closer.close()

    def _stop_engine(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._fail_all("server shutting down")

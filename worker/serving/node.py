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
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.client import ControlClient
from kvbridge.connector.control.server import ControlServer, ControlServerConfig, serve
from kvbridge.connector.control.types import PeerInfo, Role
from kvbridge.connector.offload.lookup import OffloadLookup, OffloadLookupConfig
from kvbridge.connector.scheduler import KVBridgeScheduler
from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport
from kvbridge.connector.worker_side import KVBridgeWorker
from kvbridge.proto import codec
from kvbridge.proto import engine_pb2 as epb
from kvbridge.proto import engine_pb2_grpc as epb_grpc
from kvbridge.proto.errors import ConfigError, KVBridgeError, WireError
from kvbridge.proto.layout import KVLayout
from kvbridge.proto.types import EngineId, RequestId
from kvbridge.worker.engine import Engine, EngineConfig, RequestOutput
from kvbridge.worker.serving.engine_owner import EngineBlockOwner
from kvbridge.worker.serving.metrics import NodeMetrics

__all__ = ["NodeConfig", "Node", "GenerateResult"]

log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1 << 16
MAX_ENCODER_INPUT_BYTES = 1 << 20


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

    def __post_init__(self) -> None:
        for knob in ("port", "control_port"):
            if not 0 <= getattr(self, knob) <= 65535:
                raise ConfigError(f"{knob} {getattr(self, knob)} is outside 0..65535")


@dataclass(slots=True)
class GenerateResult:
    output: RequestOutput
    transfer_ms: float = 0.0
    blocks_moved: int = 0
    load_error: str = ""
    blocks_moved_by_group: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    blocks_offloaded: int = 0


@dataclass(slots=True)
class _Submission:
    request_id: str
    prompt: list[int]
    max_tokens: int
    params: dict[str, Any] | None
    encoder_input: bytes | None = None
    future: futures.Future[GenerateResult] = field(default_factory=futures.Future)


class Node:
    """One engine with its connector and servers; ``close()`` stops everything."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        cc = config.connector
        self.transport = NixlTransport(NixlConfig(name=cc.engine_id))
        self.scheduler_connector = KVBridgeScheduler(cc, config.engine.block_size)
        self.worker_connector = KVBridgeWorker(cc, self.transport, self._client, self._peer_info)
        self.engine = Engine(
            config.engine,
            connector_scheduler=self.scheduler_connector,
            connector_worker=self.worker_connector,
        )
        self.owner = EngineBlockOwner(self.engine, cc.lease_ttl_s, self.worker_connector.seal)
        self.worker_connector.listen_for_releases(self.owner.leases.release)
        self.metrics = NodeMetrics(lambda: len(self.owner.leases))
        # the scheduler asks the daemon on its own thread: a bounded lookup-only client (as
        # vLLM's scheduler uses), so a hung daemon costs one short deadline, then a backoff
        self.offload_lookup = (
            OffloadLookup(OffloadLookupConfig(cc.offload_address)) if cc.offload_address else None
        )
        self.scheduler_connector.attach(self.owner, self.offload_lookup)
        assert self.worker_connector.memory is not None
        self.layout = self.worker_connector.memory.layout
        self.control: ControlServer = serve(
            self._peer_info(self.layout),
            self.owner.leases,
            ControlServerConfig(host=config.host, port=config.control_port, token=cc.token),
        )
        # the address peers find us at goes into kv_transfer_params
        self.scheduler_connector.config = _with_address(cc, self.control.address)
        self._inbox: queue.Queue[_Submission] = queue.Queue()
        self._waiting: dict[RequestId, _Submission] = {}
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvb-engine", daemon=True)
        self._thread.start()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(8, thread_name_prefix="kvb-infer"))
        epb_grpc.add_InferenceServicer_to_server(_InferenceServicer(self), self._grpc)
        self.port = self._grpc.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise ConfigError(f"cannot listen on {config.host}:{config.port}; pick another --port")
        self._grpc.start()
        log.info(
            "%s (%s) serving requests on %s:%d, control on %s",
            cc.engine_id,
            cc.role,
            config.host,
            self.port,
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

    def _client(self, address: str) -> ControlClient:
        cc = self.config.connector
        return ControlClient(address, token=cc.token, timeout_s=cc.control_timeout_s)

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
        self.metrics.observe(out, load)
        if sub is None:
            return
        result = GenerateResult(out)
        if load is not None:
            result.transfer_ms = load.transfer_ms
            result.blocks_moved = load.blocks_moved
            result.blocks_moved_by_group = dict(load.moved_by_group)
            result.bytes_moved = load.bytes_moved
            result.blocks_offloaded = load.blocks_offloaded
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
        free = {g: self.engine.num_free_blocks(g) for g in self.engine.pools}
        total = {g: p.num_blocks for g, p in self.engine.pools.items()}
        return epb.EngineStatsResponse(
            engine_id=self.config.connector.engine_id,
            role=self.config.connector.role,
            free_blocks=free,
            total_blocks=total,
            active_leases=len(self.owner.leases),
            running_requests=len(self._waiting),
        )

    def close(self) -> None:
        self._grpc.stop(grace=0.5).wait()
        self._stop.set()
        self._thread.join(timeout=10)
        self._fail_all("server shutting down")
        self.control.close()
        self.worker_connector.close()
        if self.offload_lookup is not None:
            self.offload_lookup.close()
        self.transport.close()

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_address(cc: ConnectorConfig, address: str) -> ConnectorConfig:
    from dataclasses import replace

    return replace(cc, control_address=cc.control_address or address)


class _InferenceServicer(epb_grpc.InferenceServicer):
    """Thin: validate, hand to the node, map errors to status codes."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def Generate(self, request: epb.GenerateRequest, context: Any) -> epb.GenerateResponse:
        try:
            prompt = list(request.prompt_token_ids)
            if not 0 < len(prompt) <= MAX_PROMPT_TOKENS:
                raise WireError(
                    f"prompt must have 1..{MAX_PROMPT_TOKENS} tokens, got {len(prompt)}"
                )
            if request.max_tokens < 1:
                raise WireError("max_tokens must be >= 1")
            if len(request.encoder_input) > MAX_ENCODER_INPUT_BYTES:
                raise WireError(
                    f"encoder_input has {len(request.encoder_input)} bytes, the limit is "
                    f"{MAX_ENCODER_INPUT_BYTES}"
                )
            params = (
                codec.unpack(request.kv_transfer_params, "KVTransferParams")
                if request.kv_transfer_params
                else None
            )
            rid = request.request_id or f"req-{time.monotonic_ns()}"
            future = self.node.submit(
                prompt, request.max_tokens, params, rid, request.encoder_input or None
            )
            result = future.result(timeout=self.node.config.request_timeout_s)
        except WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVBridgeError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "request did not finish in time")
        out = result.output
        stats = epb.RequestStats(
            prompt_tokens=out.num_prompt_tokens,
            blocks_local_hit=out.blocks_local_hit,
            blocks_moved=result.blocks_moved,
            blocks_offloaded=result.blocks_offloaded,
            blocks_recomputed=out.blocks_recomputed,
            transfer_ms=result.transfer_ms,
            ttft_ms=(out.ttft_s or 0.0) * 1e3,
            load_error=result.load_error,
            blocks_moved_by_group=result.blocks_moved_by_group,
            bytes_moved=result.bytes_moved,
            cross_source=out.cross_source,
        )
        params_bytes = (
            codec.pack("KVTransferParams", out.kv_transfer_params)
            if out.kv_transfer_params
            else b""
        )
        return epb.GenerateResponse(
            request_id=out.request_id,
            token_ids=list(out.output_token_ids),
            kv_transfer_params=params_bytes,
            stats=stats,
        )

    def EngineStats(self, request: epb.EngineStatsRequest, context: Any) -> epb.EngineStatsResponse:
        return self.node.stats()

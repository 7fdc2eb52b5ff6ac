"""The serving node's ``Inference`` gRPC API: the servicer, its server, and the edge checks.

The router (and any client) calls ``Generate`` and ``EngineStats`` here. With a
token configured, :class:`~kvbridge.connector.control.auth.TokenInterceptor`
refuses every call without it before the servicer runs; with a certificate,
the port speaks TLS only. Every field of a request is bounded here before the
node sees it.
"""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from kvbridge.connector.control.errors import MalformedRequest
from kvbridge.connector.control.grpc_server import new_server
from kvbridge.connector.params import MAX_ID_CHARS
from kvbridge.connector.server_options import ServerOptions
from kvbridge.proto import codec
from kvbridge.proto import engine_pb2 as epb
from kvbridge.proto import engine_pb2_grpc as epb_grpc
from kvbridge.proto.errors import KVBridgeError, WireError
from kvbridge.worker.engine import RequestOutput

__all__ = [
    "GenerateResult",
    "InferenceNode",
    "InferenceServicer",
    "inference_server",
    "check_request_id",
    "MAX_PROMPT_TOKENS",
    "MAX_ENCODER_INPUT_BYTES",
]

MAX_PROMPT_TOKENS = 1 << 16
MAX_ENCODER_INPUT_BYTES = 1 << 20


def inference_server(
    servicer: InferenceServicer,
    *,
    options: ServerOptions,
    max_connection_idle_s: float,
    max_concurrent_requests: int,
) -> grpc.Server:
    """The Inference gRPC server (not yet bound: :func:`~kvbridge.connector.control.
    grpc_server.bind` it to ``options``): token-checked, with bounded connections."""
    idle_ms = round(max_connection_idle_s * 1000)
    server = new_server(
        "infer",
        options,
        max_workers=8,
        max_concurrent_rpcs=max_concurrent_requests,
        grpc_options=[
            ("grpc.max_connection_idle_ms", idle_ms),  # idle clients are disconnected
            ("grpc.keepalive_time_ms", max(idle_ms // 2, 1000)),  # and dead ones found
            ("grpc.keepalive_timeout_ms", 20_000),
        ],
    )
    epb_grpc.add_InferenceServicer_to_server(servicer, server)
    return server


def check_request_id(request_id: str) -> str:
    """A request id from a client, bounded like every id in kv_transfer_params."""
    if len(request_id) > MAX_ID_CHARS or not request_id.isprintable():
        raise WireError(
            f"request_id {request_id[:64]!r} must be at most {MAX_ID_CHARS} printable "
            f"characters, got {len(request_id)}"
        )
    return request_id


@dataclass(slots=True)
class GenerateResult:
    """What one ``Generate`` call answers: the engine's output and what its load did."""

    output: RequestOutput
    transfer_ms: float = 0.0
    blocks_moved: int = 0
    load_error: str = ""
    blocks_moved_by_group: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    blocks_offloaded: int = 0
    offload_bad_digest: int = 0
    blocks_refused: int = 0
    """Blocks recomputed because the planner refused prefill's KV (``load_error`` says why)."""


class InferenceNode(Protocol):
    """What the servicer asks of the node behind it
    (:class:`~kvbridge.worker.serving.node.Node`)."""

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
        request_id: str,
        encoder_input: bytes | None = None,
    ) -> futures.Future[GenerateResult]: ...

    def stats(self) -> epb.EngineStatsResponse: ...


class InferenceServicer(epb_grpc.InferenceServicer):
    """Thin: validate, hand to the node, map errors to status codes."""

    def __init__(self, node: InferenceNode, request_timeout_s: float) -> None:
        self.node = node
        self.request_timeout_s = request_timeout_s

    def Generate(self, request: epb.GenerateRequest, context: Any) -> epb.GenerateResponse:
        try:
            if isinstance(request, MalformedRequest):
                raise WireError(f"malformed Generate request: {request.reason}")
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
            rid = check_request_id(request.request_id) or f"req-{time.monotonic_ns()}"
            future = self.node.submit(
                prompt, request.max_tokens, params, rid, request.encoder_input or None
            )
            result = future.result(timeout=self.request_timeout_s)
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
            blocks_recomputed=out.blocks_recomputed + result.blocks_refused,
            transfer_ms=result.transfer_ms,
            ttft_ms=(out.ttft_s or 0.0) * 1e3,
            load_error=result.load_error,
            blocks_moved_by_group=result.blocks_moved_by_group,
            bytes_moved=result.bytes_moved,
            cross_source=out.cross_source,
            offload_bad_digest=result.offload_bad_digest,
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
        if isinstance(request, MalformedRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.reason}")
        return self.node.stats()

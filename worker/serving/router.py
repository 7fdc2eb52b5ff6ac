"""The P/D router: prefill computes the prompt, decode continues from its KV.

For each request: send the prompt to a prefill worker with ``max_tokens=1`` and
``{"do_remote_decode": true}`` (only when a decode hop follows, ``max_tokens > 1``:
prefill pins blocks for decode only then); it answers with the first token and
``kv_transfer_params``. Send prompt + first token and those params to a decode
worker with ``max_tokens - 1``; it pulls the blocks it lacks and generates the
rest. Both hops have deadlines. An encoder-decoder request's ``encoder_input``
goes to both: prefill runs the encoder, decode uses it to name (and, if a load
fails, recompute) the cross-attention blocks. Each :class:`EngineClient` sends
the nodes' shared token and speaks TLS when given a root certificate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc

from kvbridge.connector.control.errors import TOKEN_KEY
from kvbridge.proto import codec
from kvbridge.proto import engine_pb2 as epb
from kvbridge.proto import engine_pb2_grpc as epb_grpc
from kvbridge.proto.errors import KVBridgeError

__all__ = ["Router", "RoutedResult", "EngineClient"]


class EngineClient:
    """A client of one engine's ``Inference`` service."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 120.0,
        *,
        token: str | None = None,
        root_cert: bytes | None = None,
        server_name: str | None = None,
    ) -> None:
        """``token`` is sent with every call; ``root_cert`` (PEM) makes the channel TLS,
        ``server_name`` overrides the name its certificate is checked against."""
        self.address = address
        self.timeout_s = timeout_s
        self._metadata: tuple[tuple[str, str], ...] = () if token is None else ((TOKEN_KEY, token),)
        options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
        if root_cert is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_cert)
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = epb_grpc.InferenceStub(self._channel)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        request_id: str,
        params: dict[str, Any] | None = None,
        encoder_input: bytes = b"",
    ) -> epb.GenerateResponse:
        req = epb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            kv_transfer_params=codec.pack("KVTransferParams", params) if params else b"",
            encoder_input=encoder_input,
        )
        try:
            resp: epb.GenerateResponse = self._stub.Generate(
                req, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise KVBridgeError(
                f"{self.address}: Generate {request_id} failed: {exc.code().name}: {exc.details()}"
            ) from None
        return resp

    def stats(self, timeout_s: float = 5.0) -> epb.EngineStatsResponse:
        try:
            resp: epb.EngineStatsResponse = self._stub.EngineStats(
                epb.EngineStatsRequest(), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise KVBridgeError(f"{self.address}: EngineStats failed: {exc.code().name}") from None
        return resp

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise KVBridgeError(
                f"engine at {self.address} did not come up in {timeout_s}s"
            ) from None

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True, slots=True)
class RoutedResult:
    request_id: str
    tokens: list[int]
    prefill: epb.RequestStats
    decode: epb.RequestStats
    ttft_ms: float
    total_ms: float


class Router:
    """Sends each request to prefill, then to decode with prefill's kv_transfer_params."""

    def __init__(self, prefill: EngineClient, decode: EngineClient) -> None:
        self.prefill = prefill
        self.decode = decode

    def generate(
        self, prompt: list[int], max_tokens: int, request_id: str, encoder_input: bytes = b""
    ) -> RoutedResult:
        """Route one request; ``encoder_input`` (encoder-decoder models) goes to both hops."""
        t0 = time.perf_counter()
        # no decode hop, no hand-over: prefill must not pin blocks nobody will read
        handover = {"do_remote_decode": True} if max_tokens > 1 else None
        first = self.prefill.generate(prompt, 1, request_id, handover, encoder_input)
        ttft_ms = (time.perf_counter() - t0) * 1e3
        if not first.token_ids:
            raise KVBridgeError(f"prefill returned no token for {request_id}")
        tokens = list(first.token_ids)
        decode_stats = epb.RequestStats()
        if max_tokens > 1:
            params = (
                codec.unpack(first.kv_transfer_params, "KVTransferParams")
                if first.kv_transfer_params
                else None
            )
            rest = self.decode.generate(
                prompt + tokens, max_tokens - 1, request_id, params, encoder_input
            )
            tokens += list(rest.token_ids)
            decode_stats = rest.stats
        return RoutedResult(
            request_id,
            tokens,
            first.stats,
            decode_stats,
            ttft_ms,
            (time.perf_counter() - t0) * 1e3,
        )

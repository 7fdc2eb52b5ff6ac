"""The P/D router: prefill computes the prompt, decode continues from its KV.

For each request: send the prompt to a prefill node with ``max_tokens=1`` and
``{"do_remote_decode": true}`` (only when a decode hop follows, ``max_tokens >
1``: prefill pins blocks for decode only then); it answers with the first token
and ``kv_transfer_params``. Send prompt + first token and those params to a
decode node with ``max_tokens - 1``; it pulls the blocks it lacks and
generates the rest. An encoder-decoder request's ``encoder_input`` goes to
both: prefill runs the encoder, decode uses it to name (and, if a load fails,
recompute) the cross-attention blocks. Each :class:`EngineClient` sends the
nodes' shared token and speaks TLS when given a root certificate.

**Serving through faults.** A :class:`Router` takes one or several nodes per
role. Each hop is tried on up to ``RouterConfig.attempts`` nodes of its role,
each attempt under ``attempt_timeout_s``. A node that was unreachable,
refused the connection, went away mid-request (``UNAVAILABLE``,
``CANCELLED``, ``ABORTED``) or missed the deadline (``DEADLINE_EXCEEDED``) is
marked down for ``down_s`` seconds, and the hop moves on to another node;
other errors (a bad request, a load that failed under ``--on-load-error
fail``) are answers, not faults, and are raised at once. A decode retried on
another node is still correct: it reads only what prefill's lease proves, or
recomputes what is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvbridge.connector.control.errors import TOKEN_KEY
from kvbridge.proto import codec
from kvbridge.proto import engine_pb2 as epb
from kvbridge.proto import engine_pb2_grpc as epb_grpc
from kvbridge.proto.errors import ConfigError, KVBridgeError, PeerError

__all__ = ["Placement", "Router", "RouterConfig", "RoutedResult", "EngineClient", "NodeDownError"]

_NODE_FAULTS = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)


_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    # gRPC's defaults back off reconnects from 1 s up to 2 min: a node that was down a
    # moment would stay unreachable on this channel long after it is back
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # its own connections: with gRPC's global subchannel pool a fresh channel to the same
    # address would share the old one's connection and its backoff
    ("grpc.use_local_subchannel_pool", 1),
]


class NodeDownError(PeerError):
    """A node did not answer (unreachable, gone mid-request, or past the deadline).

    The router retries such a request on another node of the same role.
    """


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
        self._options: list[tuple[str, int | str]] = [*_CHANNEL_OPTIONS]
        if server_name is not None:
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._creds = (
            None if root_cert is None else grpc.ssl_channel_credentials(root_certificates=root_cert)
        )
        self._lock = threading.Lock()
        self._retired: grpc.Channel | None = None
        self._channel, self._stub = self._connect()

    def _connect(self) -> tuple[grpc.Channel, epb_grpc.InferenceStub]:
        if self._creds is not None:
            channel = grpc.secure_channel(self.address, self._creds, options=self._options)
        else:
            channel = grpc.insecure_channel(self.address, options=self._options)
        return channel, epb_grpc.InferenceStub(channel)

    def _reconnect(self, stub: epb_grpc.InferenceStub) -> None:
        """A fresh channel after ``UNAVAILABLE`` on ``stub``'s: the old one would keep gRPC's
        reconnect backoff (seconds) for a node that restarted on the same port. The one
        before it is closed now; the one just replaced may still carry other threads'
        calls, so it is closed at the next swap or at :meth:`close`."""
        with self._lock:
            if stub is not self._stub:
                return  # another thread already swapped it
            old, self._retired = self._retired, self._channel
            self._channel, self._stub = self._connect()
        if old is not None:
            old.close()

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        request_id: str,
        params: dict[str, Any] | None = None,
        encoder_input: bytes = b"",
        *,
        timeout_s: float | None = None,
    ) -> epb.GenerateResponse:
        """One Generate call; :class:`NodeDownError` if the node did not answer."""
        req = epb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            kv_transfer_params=codec.pack("KVTransferParams", params) if params else b"",
            encoder_input=encoder_input,
        )
        stub = self._stub
        try:
            resp: epb.GenerateResponse = stub.Generate(
                req, timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                self._reconnect(stub)
            kind = NodeDownError if exc.code() in _NODE_FAULTS else KVBridgeError
            raise kind(
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
        with self._lock:
            channels = [self._channel, self._retired]
        for channel in channels:
            if channel is not None:
                channel.close()


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How hard the router tries before a request fails."""

    attempts: int = 3
    """Nodes tried per hop (prefill, decode), each at most once while others are left."""
    attempt_timeout_s: float = 120.0
    """Deadline of one Generate call; a node past it is marked down and the hop retried."""
    down_s: float = 5.0
    """How long a node that failed is skipped while a healthy one of its role is left."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"attempts must be >= 1, got {self.attempts}")
        for knob in ("attempt_timeout_s", "down_s"):
            if getattr(self, knob) <= 0:
                raise ConfigError(f"{knob} must be > 0, got {getattr(self, knob)}")


@dataclass(frozen=True, slots=True)
class RoutedResult:
    request_id: str
    tokens: list[int]
    prefill: epb.RequestStats
    decode: epb.RequestStats
    ttft_ms: float
    total_ms: float
    prefill_address: str = ""
    decode_address: str = ""
    retries: int = 0
    """Attempts beyond the first, both hops together."""


class Placement(Protocol):
    """Chooses which node of a role to try first for a prompt (placement only)."""

    def prefer(self, prompt: Sequence[int]) -> int | None:
        """Index of the preferred prefill node, or None for round robin."""
        ...


class _Pool:
    """The nodes of one role, round robin over those not marked down."""

    def __init__(self, role: str, clients: Sequence[EngineClient], down_s: float) -> None:
        if not clients:
            raise ConfigError(f"the router needs at least one {role} node")
        self.role = role
        self.clients = list(clients)
        self._down_s = down_s
        self._down_until = [0.0] * len(self.clients)
        self._next = 0
        self._lock = threading.Lock()

    def pick(self, tried: set[int], prefer: int | None = None) -> int:
        """An untried node: ``prefer`` if it is untried and healthy, else the next healthy
        one, else the one that comes back first."""
        now = time.monotonic()
        with self._lock:
            if prefer is not None and prefer not in tried and self._down_until[prefer] <= now:
                return prefer
            n = len(self.clients)
            order = [(self._next + k) % n for k in range(n)]
            fresh = [i for i in order if i not in tried] or order
            healthy = [i for i in fresh if self._down_until[i] <= now]
            choice = healthy[0] if healthy else min(fresh, key=lambda i: self._down_until[i])
            self._next = (choice + 1) % n
            return choice

    def mark_down(self, i: int) -> None:
        with self._lock:
            self._down_until[i] = time.monotonic() + self._down_s

    def mark_up(self, i: int) -> None:
        with self._lock:
            self._down_until[i] = 0.0


class Router:
    """Sends each request to a prefill node, then to a decode node with prefill's
    kv_transfer_params, retrying a hop on another node of its role when a node is down.

    ``prefill`` and ``decode`` are one :class:`EngineClient` or a sequence of them;
    ``generate`` may be called from several threads at once.
    """

    def __init__(
        self,
        prefill: EngineClient | Sequence[EngineClient],
        decode: EngineClient | Sequence[EngineClient],
        config: RouterConfig | None = None,
        placement: Placement | None = None,
    ) -> None:
        """``placement`` (e.g. :class:`~kvbridge.worker.serving.placement.EventPlacement`)
        names the prefill node to try first; the others stay the fallback."""
        self.config = config or RouterConfig()
        self._placement = placement
        self._prefill = _Pool("prefill", _as_list(prefill), self.config.down_s)
        self._decode = _Pool("decode", _as_list(decode), self.config.down_s)

    @property
    def prefill(self) -> EngineClient:
        """The first prefill node (single-pair deployments)."""
        return self._prefill.clients[0]

    @property
    def decode(self) -> EngineClient:
        """The first decode node (single-pair deployments)."""
        return self._decode.clients[0]

    def generate(
        self, prompt: list[int], max_tokens: int, request_id: str, encoder_input: bytes = b""
    ) -> RoutedResult:
        """Route one request; ``encoder_input`` (encoder-decoder models) goes to both hops.

        Raises :class:`NodeDownError` if no node of a role answered in ``attempts`` tries,
        or the node's own :class:`KVBridgeError` for a request it rejected.
        """
        t0 = time.perf_counter()
        # no decode hop, no hand-over: prefill must not pin blocks nobody will read
        handover = {"do_remote_decode": True} if max_tokens > 1 else None
        prefer = None if self._placement is None else self._placement.prefer(prompt)
        first, p_addr, p_retries = self._hop(
            self._prefill, prompt, 1, request_id, handover, encoder_input, prefer
        )
        ttft_ms = (time.perf_counter() - t0) * 1e3
        if not first.token_ids:
            raise KVBridgeError(f"prefill returned no token for {request_id}")
        tokens = list(first.token_ids)
        decode_stats = epb.RequestStats()
        d_addr, d_retries = "", 0
        if max_tokens > 1:
            params = (
                codec.unpack(first.kv_transfer_params, "KVTransferParams")
                if first.kv_transfer_params
                else None
            )
            rest, d_addr, d_retries = self._hop(
                self._decode, prompt + tokens, max_tokens - 1, request_id, params, encoder_input
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
            p_addr,
            d_addr,
            p_retries + d_retries,
        )

    def close(self) -> None:
        """Close every node's channel."""
        for client in (*self._prefill.clients, *self._decode.clients):
            client.close()

    def _hop(
        self,
        pool: _Pool,
        prompt: list[int],
        max_tokens: int,
        request_id: str,
        params: dict[str, Any] | None,
        encoder_input: bytes,
        prefer: int | None = None,
    ) -> tuple[epb.GenerateResponse, str, int]:
        tried: set[int] = set()
        errors: list[str] = []
        for attempt in range(self.config.attempts):
            i = pool.pick(tried, prefer)
            if i in tried:  # every node failed once already: give them a moment
                time.sleep(min(1.0, 0.1 * 2**attempt))
            tried.add(i)
            client = pool.clients[i]
            # a retry on a node that may still run the abandoned attempt needs its own id
            rid = request_id if attempt == 0 else f"{request_id}.retry{attempt}"
            try:
                resp = client.generate(
                    prompt,
                    max_tokens,
                    rid,
                    params,
                    encoder_input,
                    timeout_s=self.config.attempt_timeout_s,
                )
            except NodeDownError as exc:
                pool.mark_down(i)
                errors.append(str(exc))
                continue
            pool.mark_up(i)
            return resp, client.address, attempt
        raise NodeDownError(
            f"request {request_id}: no {pool.role} node answered in {self.config.attempts} "
            f"attempts: " + "; ".join(errors)
        )


def _as_list(nodes: EngineClient | Sequence[EngineClient]) -> list[EngineClient]:
    return [nodes] if isinstance(nodes, EngineClient) else list(nodes)

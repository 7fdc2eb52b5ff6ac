"""A lookup-only client of the node's CPU offload daemon, for a scheduler in another process.

vLLM plans loads in its scheduler (the EngineCore) while the KV memory, the
transport and :class:`~kvbridge.connector.offload.client.OffloadClient` live
in the worker process. The scheduler only needs one answer per request: how
many leading blocks of a prefix the daemon holds. :class:`OffloadLookup`
asks exactly that over gRPC (no NIXL, no handshake, no session) and is
called from the scheduler's thread, so it is built to never slow a step down
for long:

- one short deadline per call (``timeout_s``);
- any failure is a miss (0), logged once, and the daemon is not asked again
  for ``backoff_s`` (a dead daemon costs one deadline per backoff, not one
  per request);
- before any worker has handshaken, the daemon has no pool and answers
  ``FAILED_PRECONDITION``: also a miss, logged at debug level;
- every call carries the daemon's shared token (``token``), over TLS with
  ``root_cert`` (:mod:`kvbridge.connector.offload.wire`);
- with tensor parallelism (``tp_size`` > 1) every rank stores and loads its own
  slice of each block under its own key in the daemon, so one lookup asks every
  rank (the calls run at once) and answers the shortest prefix: a block one
  rank lacks is a miss for the whole request, never a load that mixes ranks.

A hit is a hint: the worker's PrepareLoad pins what is really there and the
load reports what it got; blocks that vanished in between are recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.proto.errors import ConfigError, KVBridgeError, WireError
from kvbridge.proto.types import BlockHash

__all__ = ["OffloadLookup", "OffloadLookupConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadLookupConfig:
    """Where the daemon is and how long the scheduler may wait for it."""

    address: str
    tp_size: int = 1
    """The engine's tensor-parallel size: lookups ask ranks ``0 .. tp_size - 1``."""
    timeout_s: float = 0.5
    backoff_s: float = 2.0
    token: str | None = None
    """The daemon's shared token; None: no auth."""
    root_cert: bytes | None = None
    """PEM of the CA of the daemon's TLS certificate; None: plaintext."""
    server_name: str | None = None

    def __post_init__(self) -> None:
        if not self.address or ":" not in self.address:
            raise ConfigError(
                f"OffloadLookupConfig.address {self.address!r} must be host:port of the daemon"
            )
        if self.tp_size < 1:
            raise ConfigError(f"OffloadLookupConfig.tp_size must be >= 1, got {self.tp_size}")
        if self.timeout_s <= 0:
            raise ConfigError(f"OffloadLookupConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.backoff_s < 0:
            raise ConfigError(f"OffloadLookupConfig.backoff_s must be >= 0, got {self.backoff_s}")
        if self.token is not None and (not self.token.isascii() or not self.token.isprintable()):
            raise ConfigError("OffloadLookupConfig.token must be printable ASCII")


class OffloadLookup:
    """``lookup(hashes) -> leading hits``; one per scheduler; not thread-safe; close it."""

    def __init__(self, config: OffloadLookupConfig) -> None:
        from kvbridge.connector.offload.wire import call_metadata, open_channel
        from kvbridge.proto import offload_pb2_grpc as pb_grpc

        self.config = config
        self._metadata = call_metadata(config.token)
        self._channel = open_channel(
            config.address,
            [
                ("grpc.enable_retries", 0),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
            root_cert=config.root_cert,
            server_name=config.server_name,
        )
        self._stub: Any = pb_grpc.OffloadStoreStub(self._channel)
        self._retry_at = 0.0
        self._failing = False

    def __call__(self, hashes: Sequence[BlockHash]) -> int:
        return self.lookup(hashes)

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` the daemon holds committed for every TP rank; 0 on
        any failure."""
        if not hashes or time.monotonic() < self._retry_at:
            return 0
        from kvbridge.proto import offload_pb2 as pb

        try:
            calls = [
                self._stub.Lookup.future(
                    pb.LookupRequest(hashes=list(hashes), tp_rank=rank),
                    timeout=self.config.timeout_s,
                    metadata=self._metadata,
                )
                for rank in range(self.config.tp_size)
            ]
            try:
                hits = min(self._hits(call, rank, len(hashes)) for rank, call in enumerate(calls))
            finally:
                for call in calls:
                    call.cancel()  # the others, once one failed; a no-op on finished calls
        except KVBridgeError as exc:
            self._retry_at = time.monotonic() + self.config.backoff_s
            quiet = self._failing or getattr(exc, "code", "") == "FAILED_PRECONDITION"
            log.log(
                logging.DEBUG if quiet else logging.WARNING,
                "offload lookup failed (a miss; next try in %.1f s): %s",
                self.config.backoff_s,
                exc,
            )
            self._failing = True
            return 0
        if self._failing:
            log.info("offload daemon at %s answers lookups again", self.config.address)
            self._failing = False
        return hits

    def _hits(self, call: Any, rank: int, asked: int) -> int:
        import grpc

        from kvbridge.connector.control.errors import error_from_rpc

        try:
            resp = call.result()
        except grpc.RpcError as err:
            where = f"Lookup {self.config.address}" + (f" (rank {rank})" if rank else "")
            raise error_from_rpc(where, err) from None
        hits = int(resp.num_hits)
        if hits > asked:
            raise WireError(f"Lookup answered {hits} hits for {asked} hashes")
        return hits

    def close(self) -> None:
        self._channel.close()

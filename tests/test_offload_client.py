"""OffloadClient: an unavailable daemon is a miss; a bug in our own code is not hidden.

The daemon is a real gRPC server on loopback over a fake transport (no bytes
move: the client's transport is a fake too, which "completes" a WRITE by
handing the daemon the notification NIXL would deliver).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from kvbridge.connector import ConnectorConfig, ServerOptions
from kvbridge.connector.offload import OffloadClient, OffloadClientConfig
from kvbridge.connector.transport import LocalMemory, PeerLink, TransferHandle
from kvbridge.proto import BlockHash, BlockId, KVLayout, negotiate, preset_layout
from kvbridge.worker.offload import OffloadConfig, OffloadServer, serve

TINY_BLOCK = 2 * 4 * 16 * 2 * 32 * 4


class DaemonTransport:
    """The daemon's side: registers nothing real, delivers queued notifications."""

    name = "daemon-agent"

    def __init__(self) -> None:
        self.notifications: dict[str, list[bytes]] = {}

    def register(self, layout: KVLayout, kv: Mapping[str, torch.Tensor]) -> LocalMemory:
        return LocalMemory(1, layout.bind(kv), "cpu")

    def unregister(self, memory: LocalMemory) -> None:
        pass

    def metadata(self) -> bytes:
        return b"daemon-metadata"

    def poll_notifications(self) -> dict[str, list[bytes]]:
        out, self.notifications = self.notifications, {}
        return out


class DoneHandle(TransferHandle):
    def poll(self) -> Any:
        return "done"

    def wait(self, timeout_s: float | None = None) -> None:
        pass

    def release(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def num_descriptors(self) -> int:
        return 0


class WorkerTransport:
    """The worker's side: a WRITE "completes" at once and notifies the daemon's transport."""

    name = "worker-agent"

    def __init__(self, daemon: DaemonTransport) -> None:
        self.daemon = daemon

    def metadata(self) -> bytes:
        return b"worker-metadata"

    def register(self, layout: KVLayout, kv: Mapping[str, torch.Tensor]) -> LocalMemory:
        return LocalMemory(7, layout.bind(kv), "cpu")

    def connect(self, peer: str, md: bytes, remote: KVLayout, local: LocalMemory) -> PeerLink:
        return PeerLink(1, peer, local, remote, negotiate(local.layout, remote).mode, 1, 0.0)

    def disconnect(self, link: PeerLink) -> None:
        pass

    def unregister(self, memory: LocalMemory) -> None:
        pass

    def write_blocks(
        self, link: PeerLink, group: str, local: Sequence[int], remote: Sequence[int], **kw: Any
    ) -> TransferHandle:
        self.daemon.notifications.setdefault(self.name, []).append(kw["notify"])
        return DoneHandle()


@pytest.fixture
def daemon() -> Iterator[tuple[OffloadServer, DaemonTransport]]:
    transport = DaemonTransport()
    config = OffloadConfig(capacity_bytes=16 * TINY_BLOCK, listen=ServerOptions(token="t0ken"))
    with serve(transport, config) as server:  # type: ignore[arg-type]
        yield server, transport


def client_for(address: str, daemon: DaemonTransport, token: str | None = "t0ken") -> OffloadClient:
    layout = preset_layout("tiny", num_blocks=8)
    local = LocalMemory(7, layout.bind(layout.allocate()), "cpu")
    config = OffloadClientConfig(
        address=address, engine_id="w", rpc_timeout_s=5.0, reconnect_backoff_s=0.0, token=token
    )
    return OffloadClient(config, WorkerTransport(daemon), local)  # type: ignore[arg-type]


def names(n: int) -> list[BlockHash]:
    return [BlockHash(bytes([i]) * 32) for i in range(n)]


def test_a_store_with_the_token_commits_after_its_write_and_is_found(
    daemon: tuple[OffloadServer, DaemonTransport],
) -> None:
    server, transport = daemon
    with client_for(server.address, transport) as client:
        result = client.store([BlockId(i) for i in range(3)], names(3))
        assert (result.stored, result.error) == (3, "")
        assert client.lookup(names(4)) == 3


def test_without_the_token_the_daemon_is_a_miss(
    daemon: tuple[OffloadServer, DaemonTransport],
) -> None:
    server, transport = daemon
    with client_for(server.address, transport, token=None) as client:
        assert client.lookup(names(2)) == 0
        result = client.store([BlockId(0)], names(1))
        assert result.stored == 0 and "AuthError" in result.error


def test_a_daemon_that_is_down_is_a_miss() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    with client_for(address, DaemonTransport()) as client:
        assert client.lookup(names(2)) == 0
        result = client.store([BlockId(0), BlockId(1)], names(2))
        assert result.stored == 0 and result.error
        assert client.load([BlockId(0)], names(1)).loaded == 0


def test_a_bug_in_the_client_propagates_instead_of_becoming_a_miss(
    daemon: tuple[OffloadServer, DaemonTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, transport = daemon
    with client_for(server.address, transport) as client:
        assert client.lookup(names(1)) == 0  # connected

        def broken(*args: Any, **kwargs: Any) -> None:
            raise TypeError("a bug")

        monkeypatch.setattr(client._mover, "transfer", broken)
        with pytest.raises(TypeError, match="a bug"):
            client.store([BlockId(0), BlockId(1)], names(2))
        pool = server.handlers.pool
        assert pool is not None
        assert pool.stats().writing_blocks == 0  # the interrupted store was aborted
        monkeypatch.setattr(client, "_call", broken)
        with pytest.raises(TypeError, match="a bug"):
            client.lookup(names(1))


def test_the_engines_worker_connector_sends_its_token_to_the_daemon(
    daemon: tuple[OffloadServer, DaemonTransport],
) -> None:
    from kvbridge.connector.worker_side import KVBridgeWorker

    server, transport = daemon
    config = ConnectorConfig("w", token="t0ken", offload_address=server.address)

    def unused(*args: Any) -> Any:
        raise AssertionError("no peer is involved")

    worker = KVBridgeWorker(config, WorkerTransport(transport), unused, unused)  # type: ignore[arg-type]
    try:
        layout = preset_layout("tiny", num_blocks=8)
        worker.register_kv_caches(layout.allocate(), layout)
        assert worker.offload is not None
        assert worker.offload.store([BlockId(0), BlockId(1)], names(2)).stored == 2
        assert worker.offload.lookup(names(3)) == 2
    finally:
        worker.close()

"""A store's CommitStore, sent while the store's last WRITEs are still running.

Used by :meth:`~kvbridge.connector.offload.client.OffloadClient.store` (worker process).
The commit needs the blocks' digests, which the worker has once it digested the last piece
(:mod:`kvbridge.connector.offload.moves`), a few pieces before the last WRITE completes.
:meth:`StoreCommit.send` posts the RPC then, without waiting, so its round trip and the
daemon's bookkeeping overlap those WRITEs instead of following them. The daemon still
publishes nothing before the store's WRITE notification arrived (which NIXL sends only once
the last WRITE completed): it waits for it up to its ``commit_wait_s``, then refuses
(``FAILED_PRECONDITION``), and :meth:`StoreCommit.result` asks once more, after the WRITE.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvbridge.connector.control.errors import error_from_rpc
from kvbridge.proto import offload_pb2 as pb
from kvbridge.proto.errors import LeaseError

__all__ = ["StoreCommit"]


class StoreCommit:
    """One store's CommitStore: :meth:`send` once the digests are known, :meth:`result` after
    the WRITEs (or :meth:`cancel` if they failed)."""

    def __init__(
        self,
        stub: Any,
        call: Callable[[str, Any], Any],
        what: str,
        timeout_s: float,
        metadata: Sequence[tuple[str, str]],
        store_id: str,
        session: str,
        key: int,
    ) -> None:
        """``stub``: the daemon's ``OffloadStoreStub``; ``call(method, request)``: the client's
        blocking call (errors mapped), for the second try; ``what``: the RPC's name in errors."""
        self._stub = stub
        self._call = call
        self._what = what
        self._timeout_s = timeout_s
        self._metadata = metadata
        self._store_id = store_id
        self._session = session
        self._key = key
        self._request: pb.CommitStoreRequest | None = None
        self._future: Any = None

    def send(self, algo: str, digests: Sequence[bytes]) -> None:
        """Post CommitStore with these digests; returns at once."""
        self._request = pb.CommitStoreRequest(
            store_id=self._store_id,
            session=self._session,
            digest_key=self._key,
            digests=list(digests),
            digest_algo=algo,
        )
        self._future = self._stub.CommitStore.future(
            self._request, timeout=self._timeout_s, metadata=self._metadata
        )

    def result(self) -> pb.CommitStoreResponse:
        """The daemon's answer (call after the store's WRITEs completed); once more if it had
        not seen the WRITE's notification yet."""
        if self._request is None:
            raise RuntimeError("StoreCommit.result() before send()")
        try:
            resp: pb.CommitStoreResponse = self._future.result()
            return resp
        except grpc.RpcError as err:
            exc = error_from_rpc(self._what, err)
        if not (isinstance(exc, LeaseError) and exc.code == "FAILED_PRECONDITION"):
            raise exc
        retried: pb.CommitStoreResponse = self._call("CommitStore", self._request)
        return retried

    def cancel(self) -> None:
        """Stop waiting for an answer (the store is being aborted)."""
        if self._future is not None:
            self._future.cancel()

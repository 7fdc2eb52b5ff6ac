"""An engine worker with an :class:`OffloadClient`, in its own process, driven by a test.

Run as ``python -m tests.harness.offload_worker NAME`` from the repository root; it
speaks ``tests.harness.frames``. Its KV
memory is filled with seeded random data so tests can compare blocks bit for
bit across processes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kvbridge.connector.offload import OffloadClient, OffloadClientConfig
from kvbridge.connector.offload.wire import store_notification
from kvbridge.connector.transport import NixlConfig, NixlTransport
from kvbridge.proto import BlockHash, BlockId, parse_order, preset_layout
from kvbridge.proto import offload_pb2 as pb
from kvbridge.worker.engine import EngineConfig
from tests.harness.frames import serve_ops
from tests.harness.transport_peer import block_bytes, fill


class Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.transport = NixlTransport(NixlConfig(name))
        self.client: OffloadClient | None = None

    def op_setup(
        self,
        address: str,
        preset: str,
        num_blocks: int,
        order: str,
        seed: int,
        token: str | None = None,
        root_cert: bytes | None = None,
        verify: bool = True,
        engine_model: str | None = None,
    ) -> dict[str, Any]:
        """``engine_model``: the layout of `kvbridge serve --model NAME` (seed 0, 16-token
        blocks) instead of the layout preset ``preset``."""
        if engine_model is None:
            self.layout = preset_layout(preset, num_blocks=num_blocks, order=order)
        else:
            engine = EngineConfig.preset(engine_model, block_size=16, num_blocks=num_blocks)
            self.layout = engine.layout().with_order(parse_order(order))
        self.kv = self.layout.allocate()
        fill(self.layout, self.kv, seed)
        self.memory = self.transport.register(self.layout, self.kv)
        config = OffloadClientConfig(
            address=address,
            engine_id=self.name,
            rpc_timeout_s=15.0,
            transfer_timeout_s=15.0,
            ttl_s=30.0,
            reconnect_backoff_s=0.2,
            token=token,
            root_cert=root_cert,
            verify=verify,
        )
        self.client = OffloadClient(config, self.transport, self.memory, self.kv)
        return {}

    def _c(self) -> OffloadClient:
        assert self.client is not None
        return self.client

    def op_lookup(self, hashes: list[bytes]) -> dict[str, Any]:
        return {"hits": self._c().lookup([BlockHash(h) for h in hashes])}

    def op_store(self, ids: list[int], hashes: list[bytes]) -> dict[str, Any]:
        r = self._c().store([BlockId(i) for i in ids], [BlockHash(h) for h in hashes])
        return {"stored": r.stored, "skipped": r.skipped, "evicted": list(r.evicted),
                "error": r.error}  # fmt: skip

    def op_load(self, ids: list[int], hashes: list[bytes]) -> dict[str, Any]:
        r = self._c().load([BlockId(i) for i in ids], [BlockHash(h) for h in hashes])
        return {"loaded": r.loaded, "error": r.error, "bad_digest": r.bad_digest}

    def op_begin_store(self, ids: list[int], hashes: list[bytes], ttl_s: float) -> dict[str, Any]:
        """PrepareStore and WRITE, but never commit (the test then kills this process)."""
        client = self._c()
        session = client._connect()
        resp = client._call(
            "PrepareStore",
            pb.PrepareStoreRequest(
                instance=session.instance,
                hashes=hashes,
                ttl_ms=round(ttl_s * 1000),
                session=session.session,
            ),
        )
        local = [ids[i] for i in resp.indices]
        notify = store_notification(resp.store_id)
        client._mover.transfer("write", session, local, list(resp.slots), notify)
        return {"slots": list(resp.slots), "store_id": resp.store_id}

    def op_prepare_store(self, hashes: list[bytes], ttl_s: float) -> dict[str, Any]:
        """PrepareStore only: the WRITE comes later (:meth:`op_write_slots`), as from a
        writer paused (GC, SIGSTOP, a slow link) between the two."""
        client = self._c()
        session = client._connect()
        req = pb.PrepareStoreRequest(
            instance=session.instance,
            hashes=hashes,
            ttl_ms=round(ttl_s * 1000),
            session=session.session,
        )
        resp = client._call("PrepareStore", req)
        return {"slots": list(resp.slots), "indices": list(resp.indices), "store_id": resp.store_id}

    def op_write_slots(
        self, ids: list[int], slots: list[int], store_id: str = ""
    ) -> dict[str, Any]:
        """NIXL WRITE of local ``ids`` into daemon ``slots`` (with the store's notification if
        ``store_id``): a late writer's WRITE, or a token holder's into blocks it does not own."""
        client = self._c()
        session = client._connect()
        notify = store_notification(store_id) if store_id else None
        client._mover.transfer("write", session, ids, slots, notify)
        return {}

    def op_pin(self, hashes: list[bytes]) -> dict[str, Any]:
        """PrepareLoad only (what any session may do): the slots and digests it answers."""
        client = self._c()
        session = client._connect()
        req = pb.PrepareLoadRequest(
            instance=session.instance, hashes=hashes, session=session.session
        )
        resp = client._call("PrepareLoad", req)
        return {"load_id": resp.load_id, "slots": list(resp.slots)}

    def op_unpin(self, load_id: str, bad: list[int]) -> dict[str, Any]:
        """CompleteLoad naming ``bad`` positions (true or not) as failing their digest."""
        client = self._c()
        session = client._connect()
        req = pb.CompleteLoadRequest(load_id=load_id, session=session.session, bad=bad)
        resp = client._call("CompleteLoad", req)
        return {"released": resp.released, "dropped": resp.dropped}

    def op_blocks(self, ids: list[int]) -> dict[str, Any]:
        return {"blocks": [block_bytes(self.layout, self.kv, "self", b) for b in ids]}

    def op_scramble(self, ids: list[int]) -> dict[str, Any]:
        for layer in self.layout.owning_layers("self"):
            self.kv[layer.name][:, ids] = 0
        return {}

    def op_stats(self) -> dict[str, Any]:
        return {"stats": self._c().stats()}

    def op_reset(self) -> dict[str, Any]:
        """Close the client and unregister the memory but keep the NIXL agent, so that one
        process serves test after test (the next ``setup`` starts afresh); returns what the
        transport still holds, all zero when nothing leaked."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if getattr(self, "memory", None) is not None:
            self.transport.unregister(self.memory)
            del self.memory
        t = self.transport
        return {"links": len(t._links), "memories": len(t._registrations), "leaked": len(t._leaked)}

    def op_close(self) -> dict[str, Any]:
        if self.client is not None:
            self.client.close()
        self.transport.close()
        return {}


def main() -> None:
    torch.set_num_threads(1)
    name = sys.argv[1]
    serve_ops(lambda: Worker(name), name)


if __name__ == "__main__":
    main()

"""kvbridge's side of one engine process, built in one order: the composition root.

kvbridge's serving node (:class:`kvbridge.worker.serving.node.Node`) and vLLM's worker
process (:class:`kvbridge.connector.vllm.worker.VllmWorker`) both run one
:class:`EngineSide`. It builds, in this order:

1. the **control port**, bound (not yet serving) when this engine serves one, so its
   address is known before anything that advertises it is built;
2. the **connector config**, once, with that address when the caller gave none
   (``kv_transfer_params`` carry it): nothing rewrites it later;
3. the **transport** (one NIXL agent, named per TP rank);
4. the **loader** (:class:`~kvbridge.connector.worker_side.KVBridgeWorker`), which
   registers the KV caches and the seal table with the transport when the engine hands
   them over (the reference engine does it in its constructor, vLLM when it has
   allocated them);
5. after registration, :meth:`serve`: the **lease table** over the engine's block
   owner (publishing seals into the registered seal table), the **release listener**
   (readers give leases back by NIXL notification), and the **control server** on the
   bound port.

``close()`` undoes whatever was built, in reverse order, also after a failed step.
The engine-specific parts (the reference engine, vLLM's held requests, the planner)
stay with the caller.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.control.leases import BlockOwner, LeaseTable
from kvbridge.connector.control.types import PeerInfo, Role
from kvbridge.proto.closing import Closing
from kvbridge.proto.types import EngineId

if TYPE_CHECKING:
    from kvbridge.connector.control.client import ControlClient
    from kvbridge.connector.control.server import ControlServer, ControlServerConfig
    from kvbridge.connector.server_options import ServerOptions
    from kvbridge.connector.transport.nixl import NixlTransport
    from kvbridge.connector.worker_side import KVBridgeWorker
    from kvbridge.proto.layout import KVLayout

__all__ = ["EngineSide"]

log = logging.getLogger(__name__)


class EngineSide(Closing):
    """Transport, loader, lease table and control server of one engine (one TP rank).

    ``control``: where this engine's control server listens (None: it serves none, a
    vLLM consumer). ``tp_rank`` / ``tp_size``: this process's rank; each rank has its own
    agent, seal table and control port.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        control: ServerOptions | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        from kvbridge.connector.control.peers import nixl_agent_name
        from kvbridge.connector.control.server import ControlServer
        from kvbridge.connector.transport.nixl import NixlConfig, NixlTransport
        from kvbridge.connector.worker_side import KVBridgeWorker

        self.tp_rank = tp_rank
        self.leases: LeaseTable | None = None
        """Made by :meth:`serve`."""
        with ExitStack() as built:
            self._control_config = None if control is None else _control_config(config, control)
            self.control: ControlServer | None = None
            if self._control_config is not None:
                self.control = ControlServer(self._control_config)
                built.callback(self.control.close)
            address = config.control_address
            if not address and self.control is not None:
                address = self.control.address
            self.config = replace(config, control_address=address)
            """The connector config this engine runs with (its control address filled in)."""
            self.transport: NixlTransport = NixlTransport(
                NixlConfig(name=nixl_agent_name(config.engine_id, tp_rank, tp_size))
            )
            built.callback(self.transport.close)
            self.loader: KVBridgeWorker = KVBridgeWorker(
                self.config, self.transport, self._client, self.peer_info
            )
            built.callback(self.loader.close)
            self._closer = built.pop_all()

    def serve(self, owner: BlockOwner) -> LeaseTable:
        """After the KV caches are registered: the lease table over ``owner``, the release
        listener, and (when this engine has a control port) the control server."""
        from kvbridge.connector.control.server import ControlHandlers

        assert self.leases is None, "serve() runs once"
        memory = self.loader.memory
        assert memory is not None, "serve() before the KV caches were registered"
        self.leases = LeaseTable(owner, seal=self.loader.seal)
        self.loader.listen_for_releases(self.leases.release)
        if self.control is not None and self._control_config is not None:
            local = self.peer_info(memory.layout)
            self.control.start(ControlHandlers(local, self.leases, self._control_config))
        return self.leases

    @property
    def layout(self) -> KVLayout:
        """The registered KV cache's layout (bound to its memory)."""
        assert self.loader.memory is not None, "no KV caches registered yet"
        return self.loader.memory.layout

    def peer_info(self, layout: KVLayout) -> PeerInfo:
        """This engine's handshake identity for ``layout``."""
        return PeerInfo(
            engine_id=EngineId(self.config.engine_id),
            role=Role(self.config.role),
            layout=layout,
            agent_metadata=self.transport.metadata(),
            control_address=self._own_address(),
            seal_layout=self.loader.seal_layout,
        )

    def _own_address(self) -> str:
        """This rank's control address (the advertised one is rank 0's)."""
        from kvbridge.connector.control.peers import rank_address

        address, rank = self.config.control_address, self.tp_rank
        return rank_address(address, rank) if address and rank else address

    def _client(self, address: str, tp_rank: int = 0) -> ControlClient:
        from kvbridge.connector.control.peers import dial_control

        # an address from kv_transfer_params is a claim: dial only peers the operator allowed
        # (rank 0's address is checked); the remote rank's port is derived from it, never
        # read (the loader picks the rank from both TP sizes)
        return dial_control(address, self.config, tp_rank)

    def close(self) -> None:
        """Stop the control server (releasing every lease), the loader, the transport."""
        if self.control is not None:
            self.control.close()  # first: no peer pins or reads while the rest stops
        self._closer.close()


def _control_config(config: ConnectorConfig, listen: ServerOptions) -> ControlServerConfig:
    from kvbridge.connector.control.server import ControlServerConfig

    return ControlServerConfig(
        listen=listen,
        default_ttl_s=config.lease_ttl_s,
        max_ttl_s=config.max_lease_ttl_s,
    )

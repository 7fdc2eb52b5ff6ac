"""The KV-connector seam between an inference engine and kvbridge.

Shaped after vLLM's KV connector v1 so that the vLLM adapter is a thin layer:
a **scheduler half** decides per request which blocks to load and what to
hand over when a request finishes, and a **worker half** owns the KV tensors
and moves bytes. In vLLM they live in different processes and talk only
through :class:`StepMetadata`, which is therefore a msgpack-able value. The
reference engine (``kvbridge.worker.engine``) runs both halves in one process
and calls them in exactly the order vLLM does:

scheduler step::

    n_ext, is_async = sched.get_num_new_matched_tokens(req, num_local_computed)
    ... allocate blocks for the request ...
    sched.update_state_after_alloc(req, block_ids, n_ext)
    meta = sched.build_connector_meta()       # once per step, after all allocations

worker step::

    worker.start_load_kv(meta)                # non-blocking
    ... forward pass (wait_for_layer_load / save_kv_layer per layer) ...
    worker.wait_for_save()
    sending, receiving = worker.get_finished(finished_request_ids)
    bad = worker.get_block_ids_with_load_errors()

and when a request finishes, ``sched.request_finished(req, block_ids)``
returns ``(delay_free, kv_transfer_params)``: with ``delay_free`` the engine
leaves the blocks referenced and frees them only when ``get_finished``
reports the request in ``sending`` (done or lease expired).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.proto.layout import KVGroup
from kvbridge.proto.types import BlockHash, BlockId, RequestId

if TYPE_CHECKING:
    import torch

    from kvbridge.proto.layout import KVLayout

__all__ = [
    "RequestView",
    "SchedulerConnector",
    "WorkerConnector",
    "StepMetadata",
    "BlockLoad",
    "BlockStore",
    "LoadResult",
]


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the connector may know about a request (scheduler side)."""

    request_id: RequestId
    prompt_token_ids: Sequence[int]
    block_hashes: Mapping[KVGroup, Sequence[BlockHash]]
    """Names of the request's full blocks per group (``self``; ``cross`` if encoder-decoder)."""
    kv_transfer_params: Mapping[str, Any] | None = None
    """Set by the router: ``do_remote_decode`` on prefill; the prefill's answer on decode."""
    encoder_hash: bytes | None = None
    prompt_computed: bool = True
    """At ``request_finished``: the request ended normally with its whole prompt computed, so
    its full prompt blocks hold the prompt's KV (False for an abort: nothing is handed over
    or stored)."""


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Load ``remote_ids`` of a remote engine into ``local_ids``, per group."""

    request_id: RequestId
    remote_engine: str
    remote_address: str
    local_ids: Mapping[KVGroup, Sequence[BlockId]]
    remote_ids: Mapping[KVGroup, Sequence[BlockId]]
    lease_id: str = ""
    remote_hashes: Mapping[KVGroup, Sequence[BlockHash]] = field(default_factory=dict)
    """The names this engine computed for the blocks it loads (a partial last block named by
    :func:`~kvbridge.connector.planner.tail_name`): the owner must answer with exactly these
    names for the ids it reads, and re-pinning by name uses them if the lease expired."""
    offload_hashes: Sequence[BlockHash] = ()
    """The first ``len(offload_hashes)`` ``self`` blocks are tried from the CPU offload daemon
    first; what it lacks comes from the remote engine (or, with no remote, is recomputed)."""
    offload_groups: Mapping[KVGroup, Sequence[BlockHash]] = field(default_factory=dict)
    """A hybrid model's blocks from the offload daemon: per attention group (``g<i>``), the
    daemon's names of the first ``len(offload_groups[group])`` of ``local_ids[group]`` (from
    the daemon alone: all of them, the window at the hit's end). Loaded with the ``self``
    blocks or not at all: a shortfall recomputes the whole load, or with a remote engine
    reads every block from it."""
    remote_request_id: str = ""
    """The request id the remote engine leased the blocks under (its owner looks it up)."""
    first_block: int = 0
    """Position of ``local_ids["self"][0]`` in the request: the owner's lease covers the whole
    prompt, the load only what follows the local prefix hit."""
    seal: bytes = b""
    """The digest the owner's lease seal must hold if the claimed ids hold this prompt's
    blocks (:func:`~kvbridge.connector.control.seal.seal_digest`); empty: no fast path."""
    remote_tp_size: int = 1
    """The remote engine's tensor-parallel size (from ``kv_transfer_params``; the handshake
    must show it): each worker rank reads its heads from the rank(s) it maps to."""
    digest_key: int | None = None
    """The hand-over's digest key; None: the load is not verified (no digests recorded, or
    verification is off on this engine)."""
    digests: Mapping[KVGroup, Sequence[bytes]] = field(default_factory=dict)
    """Per group, the digest of each block of ``remote_ids`` as its owner recorded it at
    hand-over: the bytes read must match before the engine may use them."""
    digest_algo: str | None = None
    """The algorithm of ``digests`` (:mod:`kvbridge.kernels.digest`); None: XXH3."""
    digests_at_owner: bool = False
    """``digests`` are empty: the reader asks the owner's control server for the lease's
    digests (``Digests``), concurrently with its READ; the key stays the one here."""
    lease_offsets: Mapping[KVGroup, int] = field(default_factory=dict)
    """Per attention group (``g<i>``): where ``local_ids[group][0]`` sits in the owner's
    lease of that group (its blocks of the prompt's last positions); absent: 0."""
    whole_lease: bool = False
    """``remote_ids`` are every block of the owner's lease, group by group in lease order:
    with ``digests_at_owner``, the seal's content tag can prove the bytes read (no
    ``Digests`` round trip; :func:`~kvbridge.connector.control.seal.content_tag`)."""

    def lease_offset(self, group: KVGroup) -> int:
        """Where this load's first ``group`` block sits in the owner's lease of the group."""
        return self.first_block if group == KVGroup.SELF else self.lease_offsets.get(group, 0)


@dataclass(frozen=True, slots=True)
class BlockStore:
    """Store a finished request's full blocks in the CPU offload daemon: its ``self`` blocks,
    then a hybrid model's other groups' blocks under their group names (vLLM's groups share
    their pages, so every block moves as a ``self``-shaped page)."""

    request_id: RequestId
    block_ids: Sequence[BlockId]
    hashes: Sequence[BlockHash]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What one request's load did; kept for the engine's per-request report."""

    request_id: RequestId
    blocks_requested: int
    blocks_moved: int
    bad_block_ids: tuple[BlockId, ...]
    transfer_ms: float
    error: str = ""
    moved_by_group: Mapping[KVGroup, int] = field(default_factory=dict)
    """Blocks read per group (``self``, ``cross``)."""
    bytes_moved: int = 0
    """Bytes the transport read: only layers that own KV ever move."""
    blocks_offloaded: int = 0
    """Blocks loaded from the CPU offload daemon (not counted in blocks_moved): ``self``
    blocks, and a hybrid model's other groups' blocks of a load from the daemon alone."""
    descriptors: int = 0
    """Transport descriptors the peer READs used (the seal check's not counted)."""
    wire_descriptors: int = 0
    """The same after the backend merged adjacent ones (NIXL merges descriptors adjacent in
    the request and in memory on both sides); ``descriptors`` where it does not say."""
    read_ms: float | None = None
    """The backend's own timing of the block READs, summed (NIXL telemetry, post to
    completion): the span vLLM's NixlConnector reports as its transfer time. None where the
    backend does not say; ``transfer_ms`` is the whole load (link, READs, proof, release)."""
    post_ms: float | None = None
    """Of ``read_ms``, the posts themselves (NIXL telemetry): all of it when every READ was
    done inside its post (CMA on one host), less when one completed after."""
    link_ms: float = 0.0
    """Of ``transfer_ms``, the time spent waiting for a new link to the peer (handshake and
    the link's warm-up READ); 0 when the link was already made."""
    offload_bad_digest: int = 0
    """``self`` blocks read from the offload daemon whose bytes failed their writer's digest
    (re-read from the peer or recomputed, never used)."""
    path: str = ""
    """How the peer's blocks were proven: ``sealed`` (no control RPC), ``owner`` (the owner
    named them over the control plane), or ``""`` (nothing read from a peer)."""
    digest_mismatches: int = 0
    """Blocks whose bytes, as read, did not match the digest their owner recorded at
    hand-over (each is recomputed, with every later ``self`` block)."""
    verified: bool = False
    """Whether the blocks read were checked against digests."""
    steps: tuple[tuple[str, float], ...] = ()
    """``(step, time.perf_counter())`` as the load passed each of its steps on this side, for
    the step timing logged at DEBUG by ``kvbridge.connector.load.steps``."""


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """The scheduler half's plan for one step, consumed by the worker half."""

    loads: tuple[BlockLoad, ...] = ()
    stores: tuple[BlockStore, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


class SchedulerConnector(ABC):
    """Scheduler half: runs in the engine's scheduler process, single-threaded."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (local prefix hits) that kvbridge can load,
        and whether they load asynchronously (the request then waits for ``get_finished``)."""

    @abstractmethod
    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: Mapping[KVGroup, Sequence[BlockId]],
        num_external_tokens: int,
    ) -> None:
        """The engine allocated ``block_ids`` (the request's whole block table per group)."""

    @abstractmethod
    def build_connector_meta(self) -> StepMetadata:
        """The plan for this step; resets the per-step state."""

    @abstractmethod
    def request_finished(
        self, request: RequestView, block_ids: Mapping[KVGroup, Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a finished (or aborted) request."""


class WorkerConnector(ABC):
    """Worker half: runs where the KV tensors live (the model runner)."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: KVLayout) -> None:
        """Called once at start-up with every layer's KV view and the layout describing them."""

    @abstractmethod
    def start_load_kv(self, metadata: StepMetadata) -> None:
        """Begin this step's loads; must not block on the network."""

    def wait_for_layer_load(self, layer_name: str) -> None:  # noqa: B027 - optional hook
        """Whole-block loads complete before the request is scheduled: a no-op by default."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:  # noqa: B027
        """Called after each layer's KV is written; kvbridge saves whole blocks instead."""

    def wait_for_save(self) -> None:  # noqa: B027
        """Block until this step's saves are safe to overwrite."""

    @abstractmethod
    def get_finished(
        self, finished_request_ids: set[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        """``(done_sending, done_receiving)`` request ids since the last call."""

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        """Local ``self``-group block ids whose load failed since the last call (fail closed)."""

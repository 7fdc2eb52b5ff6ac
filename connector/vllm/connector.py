"""kvbridge as a vLLM KV connector: ``KVBridgeConnector(KVConnectorBase_V1)``.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.connector.vllm",
                           "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"control_port": 7600}}'

This is the only kvbridge module that imports vLLM (0.32's connector API). vLLM makes one
instance per process and role: the **scheduler** instance (in the EngineCore) delegates to
:class:`~kvbridge.connector.vllm.scheduler.VllmScheduler` and the **worker** instance (in each
model runner) to :class:`~kvbridge.connector.vllm.worker.VllmWorker`; they talk only through
:class:`KVBridgeMetadata`, which vLLM carries from one to the other each step.

The connector asks vLLM for a block-outermost KV cache layout
(:meth:`KVBridgeConnector.get_required_kvcache_layout`, ``kv_cache_layout`` in the extra
config; model kinds kvbridge cannot serve are refused there, :mod:`.kinds`). KV tensors are
described with :meth:`KVLayout.from_tensors` after :func:`.views.logical_views` turns vLLM's
per-layer views into logical ``(2, num_blocks, block_size, H, C)`` views (``docs/VLLM.md``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed import kv_events
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.request import RequestStatus

from kvbridge.connector.base import StepMetadata
from kvbridge.connector.events import BlockRemoved, BlockStored
from kvbridge.connector.offload.lookup import OffloadLookup
from kvbridge.connector.vllm.config import VllmConnectorConfig, required_layout
from kvbridge.connector.vllm.events import OffloadEventRelay
from kvbridge.connector.vllm.kinds import (
    check_vllm_model,
    group_pages,
    layer_groups,
    layer_pages,
    vllm_groups,
)
from kvbridge.connector.vllm.logs import follow_vllm_logging
from kvbridge.connector.vllm.metrics import KVBridgePromMetrics, KVBridgeStats
from kvbridge.connector.vllm.scheduler import HoldOrder, VllmScheduler, kv_tokens
from kvbridge.connector.vllm.views import logical_views, packed_suffix
from kvbridge.connector.vllm.worker import VllmWorker, WorkerSettings
from kvbridge.proto.errors import ConfigError
from kvbridge.proto.specs import KVGroup
from kvbridge.proto.types import RequestId

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KVBridgeConnector",
    "KVBridgeMetadata",
    "KVBridgePromMetrics",
    "KVBridgeStats",
]

log = logging.getLogger(__name__)

_HANDED_OVER = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's plan, scheduler → worker: loads to start and finished requests to hold."""

    step: StepMetadata
    holds: tuple[HoldOrder, ...] = ()


GIL_SWITCH_INTERVAL_S = 0.0005
"""The worker process's interpreter switch interval while kvbridge runs in it (Python's
default is 5 ms). kvbridge's NIXL progress and load threads are Python threads: each time
one wakes (a READ to complete, a peer's READ to serve, a release to take) it must take the
GIL back from vLLM's busy step loop, which by default costs up to 5 ms. NixlConnector does
this work in NIXL's native thread instead."""


def _share_the_gil_sooner() -> None:
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def _offload_relay(cfg: VllmConnectorConfig, vllm_config: VllmConfig) -> OffloadEventRelay | None:
    if cfg.offload_events is None:
        return None
    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events:
        raise ConfigError(
            "kv_connector_extra_config.offload_kv_events relays the daemon's KV events on "
            "vLLM's own stream: enable it with --kv-events-config "
            "'{\"enable_kv_cache_events\": true, ...}'"
        )
    return OffloadEventRelay(*cfg.offload_events)


def _to_vllm(event: BlockStored | BlockRemoved) -> Any:
    """kvbridge's event as vLLM's own msgspec struct (what its publisher encodes)."""
    if isinstance(event, BlockStored):
        return kv_events.BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
        )
    return kv_events.BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium)


def _architecture(model: Any) -> str:
    """The model's class name (its first architecture), for messages."""
    return str((getattr(model, "architectures", None) or [model.model])[0])


def _tp_rank(tp_size: int) -> int:
    """This worker process's tensor-parallel rank (vLLM's TP group exists by the time the
    worker's connector is made)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge behind vLLM's KV connector API; see the module docstring.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on (one KV cache group per
    attention kind); kvbridge moves every group, a sliding-window group's in-window blocks
    only (:mod:`kvbridge.connector.windows`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        follow_vllm_logging()
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        model = vllm_config.model_config
        self._cfg = VllmConnectorConfig.from_vllm(
            ktc.kv_role,
            ktc.engine_id,
            ktc.kv_connector_extra_config,
            model=str(model.served_model_name or model.model),
        )
        self._block_size = vllm_config.cache_config.block_size
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise ConfigError(
                f"kvbridge's vLLM connector does not support pipeline parallelism "
                f"(pipeline_parallel_size={par.pipeline_parallel_size}); use 1"
            )
        tp_size = par.tensor_parallel_size
        self._num_kv_heads = model.get_num_kv_heads(par)
        self._head_size = model.get_head_size()
        # vLLM keeps its hybrid KV cache manager on (SupportsHMA): a KV cache group kind
        # kvbridge cannot move is refused here, at startup
        self._groups, windows = vllm_groups(kv_cache_config, _architecture(model))
        # groups of their own page shape (Gemma-4's): self's block and head size are its
        # group's, the others' pages enter the names' fingerprint
        heads = (self._num_kv_heads, model.get_total_num_kv_heads())
        pages = group_pages(kv_cache_config, self._groups, *heads)
        if pages:
            self._block_size = pages[KVGroup.SELF].block_size
            self._head_size = pages[KVGroup.SELF].head_size
        self._kv_cache_config = kv_cache_config
        self._scheduler: VllmScheduler | None = None
        self._worker: VllmWorker | None = None
        self._lookup: OffloadLookup | None = None
        self._relay: OffloadEventRelay | None = None
        if role == KVConnectorRole.SCHEDULER:
            hasher = self._cfg.hasher(
                dtype=str(model.dtype).removeprefix("torch."),
                num_layers=model.get_num_layers(par),
                num_kv_heads=model.get_total_num_kv_heads(),
                head_size=self._head_size,
                block_size=self._block_size,
                pages={str(g): p for g, p in pages.items()},
            )
            self._lookup = self._cfg.offload_lookup(tp_size)
            self._relay = _offload_relay(self._cfg, vllm_config)
            self._scheduler = VllmScheduler(
                self._cfg.connector,
                self._block_size,
                hasher,
                self._lookup,
                tp_size,
                groups=self._groups,
                windows=windows,
                block_sizes={g: p.block_size for g, p in pages.items()},
            )
        else:
            _share_the_gil_sooner()
            self._worker = VllmWorker(
                self._cfg.connector,
                WorkerSettings(
                    model_name=self._cfg.model_id,
                    block_size=self._block_size,
                    control_host=self._cfg.control_host,
                    control_port=self._cfg.control_port,
                    tp_rank=_tp_rank(tp_size),
                    tp_size=tp_size,
                    tls_cert=self._cfg.tls_cert,
                    tls_key=self._cfg.tls_key,
                ),
            )

    # ----- worker side ---------------------------------------------------------------------
    @property
    def worker(self) -> VllmWorker:
        assert self._worker is not None, "a worker-side call on the scheduler instance"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        shares = self._shares()
        views, interior = logical_views(
            kv_caches,
            num_kv_heads=self._num_kv_heads,
            head_size=self._head_size,
            block_size=self._block_size,
            pages=layer_pages(self._kv_cache_config, kv_caches, shares),
        )
        groups = layer_groups(self._kv_cache_config, self._groups, kv_caches, shares)
        self.worker.register(views, "" if interior is None else packed_suffix(interior), groups)

    def _shares(self) -> dict[str, str]:
        """Each KV-sharing layer's target (``kv_sharing_target_layer_name``), from vLLM's
        attention layers (the model is loaded by the time the caches are registered)."""
        layers = self._vllm_config.compilation_config.static_forward_context
        return {
            name: str(target)
            for name, layer in layers.items()
            if (target := getattr(layer, "kv_sharing_target_layer_name", None))
        }

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout kvbridge asks vLLM for: ``kv_cache_layout`` of the extra config
        (default ``BLHNC``, block-outermost: one descriptor per block; ``auto`` asks for
        nothing). vLLM drops a layout its attention backends do not declare, with a
        warning, and uses its own first choice (``LBHNC`` on the CPU backend)."""
        check_vllm_model(vllm_config.model_config)  # before vLLM builds its KV cache
        ktc = vllm_config.kv_transfer_config
        extra = None if ktc is None else ktc.kv_connector_extra_config
        return required_layout(extra)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self.worker.start_step(meta.step, meta.holds)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete before the request is scheduled (async); nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Decode pulls whole blocks; prefill saves nothing."""

    def wait_for_save(self) -> None:
        """Nothing is saved asynchronously."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, receiving = self.worker.get_finished()
        return (set(sending) or None), (set(receiving) or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and with several KV cache groups the receives that failed:
        vLLM maps failed block ids back to requests for one group only (block ids repeat
        across groups), so a hybrid model's failed load is reported by request and vLLM
        recomputes it whole."""
        sending, receiving = self.worker.get_finished()
        failed = self.worker.take_failed()  # taken every step, used with several groups
        failed = failed if len(self._groups) > 1 else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending), finished_recving=set(receiving), failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad = {int(b) for b in self.worker.load_errors()}
        return set() if len(self._groups) > 1 else bad  # several groups: get_transfer_results

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This step's loads (vLLM calls it every step, on both halves; the scheduler has
        none), reset as they are taken."""
        data = None if self._worker is None else self._worker.stats.take()
        return None if data is None else KVBridgeStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVBridgeStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._lookup is not None:
            self._lookup.close()
        if self._relay is not None:
            self._relay.close()

    # ----- scheduler side ------------------------------------------------------------------
    @property
    def scheduler(self) -> VllmScheduler:
        assert self._scheduler is not None, "a scheduler-side call on a worker instance"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.num_matched(
            RequestId(request.request_id),
            request.prompt_token_ids or (),
            request.kv_transfer_params,
            num_computed_tokens,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.after_alloc(
            RequestId(request.request_id),
            request.prompt_token_ids or (),
            blocks.get_block_ids(),
            num_external_tokens,
        )

    def take_events(self) -> Iterable[Any]:
        """The offload daemon's KV events, for vLLM's own publisher (``offload_kv_events``)."""
        return () if self._relay is None else [_to_vllm(e) for e in self._relay.take()]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        step, holds = self.scheduler.build_step()
        return KVBridgeMetadata(step, holds)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls :meth:`request_finished_all_groups` (``SupportsHMA``); this is the
        one-group form of it."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        prompt = request.prompt_token_ids or ()
        done = request.status in _HANDED_OVER and request.num_computed_tokens >= len(prompt)
        return self.scheduler.request_finished(
            RequestId(request.request_id),
            prompt,
            request.kv_transfer_params,
            block_ids,
            done,
            kv_tokens(request.all_token_ids, request.num_computed_tokens) if done else None,
        )

"""Span-copy plans kept between calls, keyed by the exact tensors a call addresses.

A CPU copy, convert, gather or scatter by the compiled span copy
(:mod:`kvbridge.kernels.cpu_spans`) needs, besides its block ids, the
tables of :func:`~kvbridge.kernels.cpu_spans.plan_pairs`: view pairs,
coalesced views, run offsets, view addresses. Building them, with the
checks of every layer tensor on the way (:func:`~kvbridge.kernels.views.group_views`,
:func:`~kvbridge.kernels.views.staging_view`), cost about 0.4 ms per call after a big
copy had evicted the interpreter's and torch's working set: more than a tenth
of a 64 MiB copy. A caller moves blocks between the same caches call after
call, so :func:`run_cached` keeps the plans.

The key is everything a plan depends on: the operation, the layouts (the
same objects: a layout is frozen; the plan holds them, so their ``id`` stays
theirs), the group, :data:`~kvbridge.kernels.cpu_spans.MIN_RUN_BYTES`, and
for every tensor taking part (each owning layer's, the staging buffer) its
address, shape, strides, dtype and device. A tensor changed in place (moved,
resized, restrided) or a cache dict holding another tensor makes another key,
so a plan is only reused for tensors that passed the same checks with the
same facts; a missing layer or a wrong type makes no key, and the uncached
path raises its usual error. Block ids are checked on every call by the
caller, and whether source and destination may overlap is decided per call.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch

from kvbridge.kernels import cpu_spans
from kvbridge.proto.layout import KVGroup, KVLayout

__all__ = ["MAX_PLANS", "cache_facts", "clear", "run_cached", "tensor_facts"]

#: plans kept (least recently used dropped first)
MAX_PLANS = 64

Facts = tuple[object, ...]
Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class _Entry:
    __slots__ = ("layouts", "plan", "shared")

    def __init__(
        self, layouts: tuple[KVLayout, ...], plan: cpu_spans.Plan | None, shared: bool
    ) -> None:
        self.layouts = layouts  # held: their ids in the key stay theirs
        self.plan = plan  # None: the span copy does not apply (runs too short)
        self.shared = shared  # a side shares storage with the other (a copy within a cache)


_PLANS: OrderedDict[tuple[object, ...], _Entry] = OrderedDict()
_LOCK = threading.Lock()


def clear() -> None:
    """Forget every plan (tests)."""
    with _LOCK:
        _PLANS.clear()


def tensor_facts(t: object) -> Facts | None:
    """What a plan depends on of one tensor; ``None`` for anything else or a non-CPU one."""
    if not isinstance(t, torch.Tensor) or not t.is_cpu:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def cache_facts(
    cache: Mapping[str, torch.Tensor], layout: KVLayout, group: KVGroup
) -> Facts | None:
    """:func:`tensor_facts` of each owning layer's tensor, in order; ``None`` if one is not
    a CPU tensor or is missing (the uncached path then raises the error)."""
    out = []
    for layer in layout.owning_layers(group):
        facts = tensor_facts(cache.get(layer.name))
        if facts is None:
            return None
        out.append(facts)
    return tuple(out)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def run_cached(
    kind: str,
    layouts: tuple[KVLayout, ...],
    group: KVGroup,
    sides: Sequence[Facts | None],
    build: Callable[[], Pairs],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    lead: int,
) -> bool:
    """Move the blocks by the span copy with a kept (or new) plan; ``False`` if it does not
    apply (not built, a side not on the CPU, runs too short, a copy that may overlap).

    ``sides`` are the :func:`cache_facts` / :func:`tensor_facts` of the call's tensors (with
    anything else the plan depends on, e.g. a staging buffer's block count); ``build``
    checks the tensors and returns the view pairs (``views.paired_views``), called only
    when no plan is kept for this key. ``src_ids``/``dst_ids`` are checked already.
    """
    if cpu_spans.native_module() is None or any(s is None for s in sides):
        return False
    key = (kind, lead, group, cpu_spans.MIN_RUN_BYTES, *map(id, layouts), *sides)
    entry = _PLANS.get(key)
    if entry is not None and all(a is b for a, b in zip(entry.layouts, layouts, strict=True)):
        with _LOCK:  # callers on several threads (e.g. a loader's pool) share the plans
            if key in _PLANS:
                _PLANS.move_to_end(key)
    else:
        pairs = build()
        shared = kind == "copy" and any(_storage(a) == _storage(b) for a, b in pairs)
        entry = _Entry(layouts, cpu_spans.plan_pairs(pairs, lead), shared)
        with _LOCK:
            _PLANS[key] = entry
            while len(_PLANS) > MAX_PLANS:
                _PLANS.popitem(last=False)
    if entry.plan is None:
        return False
    if entry.shared and bool(torch.isin(src_ids, dst_ids).any()):
        return False  # every source read before any write: the torch path
    cpu_spans.run_plan(entry.plan, src_ids, dst_ids)
    return True

"""Which kinds of vLLM model kvbridge's connector serves, decided at startup.

Imports no vLLM: the adapter (:mod:`kvbridge.connector.vllm.connector`) passes plain values.
A model kvbridge cannot serve is refused with a :class:`~kvbridge.proto.errors.ConfigError`
that names the model kind and the reason, before vLLM builds its KV cache: otherwise vLLM
fails later with a message about its own internals (``docs/VLLM.md``, "Model kinds").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.proto.errors import ConfigError, LayoutError
from kvbridge.proto.specs import DTYPE_BYTES, KVGroup, PageShape, attention_group

__all__ = [
    "ENCODER_DECODER_REFUSAL",
    "STATE_SPACE_REFUSAL",
    "GroupKind",
    "check_model_kind",
    "check_vllm_model",
    "group_pages",
    "layer_groups",
    "layer_pages",
    "plan_groups",
    "vllm_group_kinds",
    "vllm_groups",
]

ENCODER_DECODER_REFUSAL = (
    "vLLM 0.32 runs no KV connector with encoder-decoder models: its scheduler asserts "
    "'Encoder-decoder models are not currently supported with KV connectors' "
    "(vllm/v1/core/sched/scheduler.py, Scheduler.__init__)"
)


STATE_SPACE_REFUSAL = (
    "its Mamba (state-space) layers keep one running state per request, not KV blocks "
    "per token, and kvbridge moves only attention KV blocks"
)


def check_model_kind(
    architecture: str,
    *,
    is_encoder_decoder: bool,
    has_state_space_layers: bool = False,
) -> None:
    """Refuse a model kvbridge's vLLM connector cannot serve (``architecture``: the model's
    class name, for the message): encoder-decoder models, and models with Mamba layers
    (vLLM's ``is_hybrid`` or ``is_attention_free``)."""
    if is_encoder_decoder:
        raise ConfigError(
            f"kvbridge's vLLM connector cannot serve {architecture}: it is an encoder-decoder "
            f"model, and {ENCODER_DECODER_REFUSAL}; start it without --kv-transfer-config"
        )
    if has_state_space_layers:
        raise ConfigError(
            f"kvbridge's vLLM connector cannot serve {architecture}: {STATE_SPACE_REFUSAL} "
            "(a MambaSpec KV cache group); start it without --kv-transfer-config"
        )


def check_vllm_model(model_config: Any) -> None:
    """:func:`check_model_kind` for vLLM's ``ModelConfig`` (its first architecture names it)."""
    archs = getattr(model_config, "architectures", None) or [str(model_config.model)]
    check_model_kind(
        str(archs[0]),
        is_encoder_decoder=bool(model_config.is_encoder_decoder),
        has_state_space_layers=bool(model_config.is_hybrid or model_config.is_attention_free),
    )


_GROUP_REFUSALS = {
    "MambaSpec": STATE_SPACE_REFUSAL,
    "CrossAttentionSpec": "it is an encoder-decoder model's cross-attention KV, and "
    + ENCODER_DECODER_REFUSAL,
    "ChunkedLocalAttentionSpec": "kvbridge does not yet work out which blocks of chunked "
    "local attention a decode's next tokens attend to",
}


@dataclass(frozen=True, slots=True)
class GroupKind:
    """One of vLLM's KV cache groups, as plain values: its spec's class name (the inner
    specs' for ``UniformTypeKVCacheSpecs``), its sliding window in tokens (None: none),
    the shape of its pages (KV heads, head size, dtype name, block size in tokens), and
    whether vLLM padded its pages (``page_size_padded``: a page that does not divide the
    largest one is read through a strided view)."""

    spec: str
    window: int | None
    shape: tuple[int, int, str, int]
    padded: bool = False


def _shape(g: GroupKind) -> str:
    heads, size, dtype, block = g.shape
    return f"{heads} KV heads x {size} ({dtype}, {block}-token blocks)"


def _page_bytes(g: GroupKind) -> int:
    heads, size, dtype, block = g.shape
    return 2 * heads * size * block * DTYPE_BYTES.get(dtype, 0)


def _other_shape(g: GroupKind, own: GroupKind) -> str | None:
    """Why kvbridge cannot move group ``g`` beside the ``self`` group ``own`` whose pages
    have another shape; None where it can: same dtype, equal page bytes (``g``'s block
    ``j`` is then one page of the pool, as vLLM keeps it), and blocks of a whole multiple
    of ``own``'s tokens (``g``'s block ``j`` covers ``self`` blocks ``j*r`` .. ``j*r+r-1``)."""
    if g.shape[2] != own.shape[2] or _page_bytes(g) != _page_bytes(own) or not _page_bytes(g):
        return "kvbridge moves groups of other page shapes only at equal page bytes"
    if g.shape[3] % own.shape[3]:
        return (
            "kvbridge moves a group of another page shape only if its blocks are a whole "
            "multiple of the main group's"
        )
    return None


def plan_groups(
    groups: Sequence[GroupKind], architecture: str
) -> tuple[int, dict[int, int | None]]:
    """Which of vLLM's KV cache groups is kvbridge's ``self`` group and the others' windows:
    ``(main index, {index: window or None})``. The main group is the first full-attention
    group (the first group if there is none). kvbridge moves full-attention and
    sliding-window groups whose pages have the main group's shape, or another shape of the
    same bytes with blocks a whole multiple of the main group's (Gemma-4's wider
    full-attention heads beside longer sliding-window blocks); any other group (another
    kind, padded pages, other page bytes or block ratios) is refused here, at startup, with
    a :class:`ConfigError` that names the group kind."""
    for i, g in enumerate(groups):
        if g.spec not in ("FullAttentionSpec", "SlidingWindowSpec"):
            why = _GROUP_REFUSALS.get(
                g.spec, "kvbridge moves full-attention and sliding-window KV blocks only"
            )
            raise ConfigError(
                f"kvbridge's vLLM connector cannot serve {architecture}: its KV cache group "
                f"{i} is a {g.spec} group, and {why}; start it without --kv-transfer-config"
            )
    if not groups:
        raise ConfigError(f"vLLM gave kvbridge no KV cache groups for {architecture}")
    full = [i for i, g in enumerate(groups) if g.spec == "FullAttentionSpec"]
    main = full[0] if full else 0
    own = groups[main]
    for i, g in enumerate(groups):
        if g.padded:
            raise ConfigError(
                f"kvbridge's vLLM connector cannot serve {architecture}: its KV cache group "
                f"{i} ({g.spec}) has padded pages of {_shape(g)} (vLLM's page_size_padded), "
                "and kvbridge moves dense pages only; start it without --kv-transfer-config"
            )
        refusal = None if g.shape == own.shape else _other_shape(g, own)
        if refusal is not None:
            raise ConfigError(
                f"kvbridge's vLLM connector cannot serve {architecture}: its KV cache group "
                f"{i} ({g.spec}) has pages of {_shape(g)}, group {main} ({own.spec}) of "
                f"{_shape(own)}; {refusal}; start it without --kv-transfer-config"
            )
    windows = {i: g.window for i, g in enumerate(groups) if i != main}
    return main, windows


def vllm_group_kinds(kv_cache_config: Any) -> list[GroupKind]:
    """:class:`GroupKind` of each of vLLM's ``KVCacheConfig.kv_cache_groups`` (duck-typed:
    no vLLM import)."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        if isinstance(inner, dict) and inner:  # UniformTypeKVCacheSpecs: one kind inside
            kinds = {type(x).__name__ for x in inner.values()}
            spec = next(iter(inner.values())) if len(kinds) == 1 else spec
        shape = (
            int(getattr(spec, "num_kv_heads", 0) or 0),
            int(getattr(spec, "head_size", 0) or 0),
            str(getattr(spec, "dtype", "")).removeprefix("torch."),
            int(getattr(spec, "block_size", 0) or 0),
        )
        window = getattr(spec, "sliding_window", None)
        pad = getattr(spec, "page_size_padded", None)
        padded = pad is not None and pad != getattr(spec, "real_page_size_bytes", pad)
        out.append(GroupKind(type(spec).__name__, int(window) if window else None, shape, padded))
    return out


def vllm_groups(
    kv_cache_config: Any, architecture: str
) -> tuple[tuple[KVGroup, ...], dict[KVGroup, int | None]]:
    """kvbridge's name of each of vLLM's KV cache groups (by vLLM's index: ``self`` for the
    main full-attention group, ``g<i>`` for the others) and the others' sliding windows
    (:func:`plan_groups`: raises ConfigError for a group kind kvbridge cannot move). The
    offload daemon keeps every group's blocks, each under its group's names."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) <= 1:
        return (KVGroup.SELF,), {}
    main, windows = plan_groups(vllm_group_kinds(kv_cache_config), architecture)
    count = len(kv_cache_config.kv_cache_groups)
    names = tuple(KVGroup.SELF if i == main else attention_group(i) for i in range(count))
    return names, {names[i]: w for i, w in windows.items()}


def layer_groups(
    kv_cache_config: Any,
    names: Sequence[KVGroup],
    layers: Iterable[str],
    shares: Mapping[str, str] | None = None,
) -> dict[str, KVGroup] | None:
    """Each layer's kvbridge group (``names``: :func:`vllm_groups`'s) when vLLM keeps several
    KV cache groups (their layers share pages: a block id belongs to one group at a time);
    None for one group. ``shares``: a KV-sharing layer's target layer (vLLM lists only the
    targets in the connector's groups); it is in its target's group."""
    if len(names) == 1 or kv_cache_config is None:
        return None
    out = {
        layer: names[i]
        for i, group in enumerate(kv_cache_config.kv_cache_groups)
        for layer in group.layer_names
    }
    for layer, target in (shares or {}).items():
        if layer not in out and target in out:
            out[layer] = out[target]
    missing = sorted(set(layers) - set(out))
    if missing:
        raise LayoutError(f"vLLM put layers {missing} in none of its KV cache groups")
    return out


def layer_pages(
    kv_cache_config: Any, layers: Iterable[str], shares: Mapping[str, str] | None = None
) -> dict[str, tuple[int, int, int]] | None:
    """Each layer's page shape ``(KV heads of this rank, head size, block size)`` from its
    KV cache group's spec, when vLLM keeps several groups (a hybrid model's groups may
    differ in head size and block size); None for one group (every layer has the model's
    shape), and for groups of one shape. ``shares`` as for :func:`layer_groups`: a
    KV-sharing layer has its target's."""
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) <= 1:
        return None
    kinds = vllm_group_kinds(kv_cache_config)
    if len({kind.shape for kind in kinds}) == 1:
        return None
    out = {
        layer: (kind.shape[0], kind.shape[1], kind.shape[3])
        for kind, group in zip(kinds, kv_cache_config.kv_cache_groups, strict=True)
        for layer in group.layer_names
    }
    for layer, target in (shares or {}).items():
        if layer not in out and target in out:
            out[layer] = out[target]
    return {layer: out[layer] for layer in layers if layer in out}


def group_pages(
    kv_cache_config: Any, names: Sequence[KVGroup], heads_per_rank: int, total_heads: int
) -> dict[KVGroup, PageShape]:
    """The page shape of every group (by kvbridge's ``names``, :func:`vllm_groups`'s),
    ``self`` included, when some group's differs from ``self``'s (KV heads of the whole
    model: a spec's heads of one rank times ``total_heads // heads_per_rank``, the model's);
    empty where every group has one shape (the hasher and the scheduler then see the model
    as before)."""
    if kv_cache_config is None or len(names) <= 1:
        return {}
    kinds = vllm_group_kinds(kv_cache_config)
    if len({kind.shape for kind in kinds}) == 1:
        return {}
    scale = max(1, total_heads // max(1, heads_per_rank))
    return {
        name: PageShape(kind.shape[3], kind.shape[0] * scale, kind.shape[1])
        for name, kind in zip(names, kinds, strict=True)
    }

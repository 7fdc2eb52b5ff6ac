"""Which kinds of vLLM model kvbridge's connector serves, decided at startup.

Imports no vLLM: the adapter (:mod:`kvbridge.connector.vllm.connector`) passes plain values.
A model kvbridge cannot serve is refused with a :class:`~kvbridge.proto.errors.ConfigError`
that names the model kind and the reason, before vLLM builds its KV cache: otherwise vLLM
fails later with a message about its own internals (``docs/VLLM.md``, "Model kinds").
"""

from __future__ import annotations

from typing import Any

from kvbridge.proto.errors import ConfigError

__all__ = [
    "ENCODER_DECODER_REFUSAL",
    "STATE_SPACE_REFUSAL",
    "check_model_kind",
    "check_vllm_model",
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

"""Which kinds of vLLM model kvbridge's connector serves, decided at startup.

Imports no vLLM: the adapter (:mod:`kvbridge.connector.vllm.connector`) passes plain values.
A model kvbridge cannot serve is refused with a :class:`~kvbridge.proto.errors.ConfigError`
that names the model kind and the reason, before vLLM builds its KV cache: otherwise vLLM
fails later with a message about its own internals (``docs/VLLM.md``, "Model kinds").
"""

from __future__ import annotations

from typing import Any

from kvbridge.proto.errors import ConfigError

__all__ = ["ENCODER_DECODER_REFUSAL", "check_model_kind", "check_vllm_model"]

ENCODER_DECODER_REFUSAL = (
    "vLLM 0.32 runs no KV connector with encoder-decoder models: its scheduler asserts "
    "'Encoder-decoder models are not currently supported with KV connectors' "
    "(vllm/v1/core/sched/scheduler.py, Scheduler.__init__)"
)


def check_model_kind(architecture: str, *, is_encoder_decoder: bool) -> None:
    """Refuse a model kvbridge's vLLM connector cannot serve (``architecture``: the model's
    class name, for the message)."""
    if is_encoder_decoder:
        raise ConfigError(
            f"kvbridge's vLLM connector cannot serve {architecture}: it is an encoder-decoder "
            f"model, and {ENCODER_DECODER_REFUSAL}; start it without --kv-transfer-config"
        )


def check_vllm_model(model_config: Any) -> None:
    """:func:`check_model_kind` for vLLM's ``ModelConfig`` (its first architecture names it)."""
    archs = getattr(model_config, "architectures", None) or [str(model_config.model)]
    check_model_kind(str(archs[0]), is_encoder_decoder=bool(model_config.is_encoder_decoder))

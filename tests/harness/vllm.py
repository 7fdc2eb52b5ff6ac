"""The vLLM tests' common start: the ``.venv-vllm`` environment and the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.worker.vllm import VenvError, ensure_venv, write_model


def model_or_skip(tmp: Path) -> Path:
    """Build ``.venv-vllm`` if missing (skip the test without it), then write the tiny
    Llama under ``tmp``; returns the model directory."""
    try:
        ensure_venv(log=tmp / "venv.log")
    except VenvError as exc:
        pytest.skip(f"no vLLM environment: {exc}")
    return write_model(tmp / "model")

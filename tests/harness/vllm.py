"""The vLLM tests' common start: the ``.venv-vllm`` environment and the tiny model.

Both are made once per test session: checking the environment imports vLLM in a child
process and writing the model starts that venv's torch, ~10 s of CPU each, which every
vLLM test module would otherwise pay again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.worker.vllm import VenvError, ensure_venv, write_model

_session: dict[str, Path | str] = {}
"""``"venv"``: the checked vLLM python, or ``"error"``: why there is none; ``"model"``: the
tiny Llama written by the first module that asked (it lives in pytest's session temp dir)."""


def model_or_skip(tmp: Path) -> Path:
    """Build ``.venv-vllm`` if missing (skip the test without it), then write the tiny
    Llama under ``tmp`` (once per session; later calls get the first one); returns the
    model directory."""
    if "venv" not in _session and "error" not in _session:
        try:
            _session["venv"] = ensure_venv(log=tmp / "venv.log")
        except VenvError as exc:
            _session["error"] = str(exc)
    if "error" in _session:
        pytest.skip(f"no vLLM environment: {_session['error']}")
    if "model" not in _session:
        _session["model"] = write_model(tmp / "model")
    model = _session["model"]
    assert isinstance(model, Path)
    return model

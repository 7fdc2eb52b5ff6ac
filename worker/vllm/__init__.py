"""vLLM engines as child processes, for tests, examples and benchmarks.

vLLM's CPU build lives in its own virtual environment (:mod:`.venv`); the main
environment drives it through :class:`Engine` (:mod:`.engine`), which starts
:mod:`.instance` there and speaks JSON lines to it. :mod:`.tiny_llama` writes a
seeded random Llama small enough to run on a CPU in seconds, :mod:`.tiny_gemma` a
Gemma-3-style hybrid one (the tests' tiny models of other kinds are in
``tests/harness/tiny_models.py``). kvbridge's connector
that runs *inside* vLLM is :mod:`kvbridge.connector.vllm`.
"""

from kvbridge.worker.vllm.engine import Engine, kv_config, pair_configs, running, tokens
from kvbridge.worker.vllm.venv import (
    PYTHON,
    RECIPE,
    ROOT,
    VenvError,
    ensure_venv,
    write_hybrid_model,
    write_model,
)

__all__ = [
    "PYTHON",
    "RECIPE",
    "ROOT",
    "Engine",
    "VenvError",
    "ensure_venv",
    "kv_config",
    "pair_configs",
    "running",
    "tokens",
    "write_hybrid_model",
    "write_model",
]

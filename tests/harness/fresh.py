"""Code run in a fresh interpreter: what an import loads is only visible there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_python(code: str, cwd: Path | str | None = None, timeout_s: float = 60.0) -> str:
    """``python -c code``'s stdout; raises with its stderr if it fails."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=timeout_s
    )
    assert done.returncode == 0, f"python -c {code!r} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def assert_importing_loads_none_of(modules: list[str], prefixes: tuple[str, ...]) -> None:
    """Importing ``modules`` in a fresh interpreter loads no module starting with ``prefixes``."""
    run_python(
        f"import sys, {', '.join(modules)};"
        f"bad = [m for m in sys.modules if m.startswith({prefixes!r})];"
        "assert not bad, bad"
    )

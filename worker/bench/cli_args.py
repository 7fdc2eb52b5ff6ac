"""The command-line shape every ``kvbridge bench X`` shares.

``--out PREFIX`` (alias ``--json``) names the two files a benchmark writes:
``PREFIX.json`` (machine, settings, rows) and ``PREFIX.png`` (the plot); the
default is ``results/bench-X``. A trailing ``.json`` or ``.png`` on PREFIX is
dropped, so ``--json results/x.json`` writes ``results/x.json`` and ``results/x.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_output_arguments", "output_paths", "settings_of"]

_SUFFIXES = (".json", ".png")


def _prefix(text: str) -> Path:
    path = Path(text)
    return path.with_suffix("") if path.suffix in _SUFFIXES else path


def add_output_arguments(parser: argparse.ArgumentParser, bench: str) -> None:
    """Add ``--out PREFIX`` / ``--json PREFIX`` (default ``results/bench-<bench>``)."""
    parser.add_argument(
        "--out",
        "--json",
        dest="out",
        type=_prefix,
        default=Path(f"results/bench-{bench}"),
        metavar="PREFIX",
        help=f"write PREFIX.json and PREFIX.png (default results/bench-{bench})",
    )


def output_paths(prefix: Path) -> tuple[Path, Path]:
    """``(PREFIX.json, PREFIX.png)``; a dot inside the name (``run.v2``) is kept."""
    return prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".png")


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags worth recording in the JSON (not the handler, not the output prefix)."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "out", "command", "bench")}

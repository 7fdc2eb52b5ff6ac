"""Saving benchmark figures: every ``kvbridge bench`` writes JSON and a PNG plot.

Figures are compared as ratios within one run (these machines are noisy);
the JSON records the machine and the settings so runs can be told apart.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvbridge.proto.version import __version__

__all__ = ["machine_info", "write_json", "bar_plot", "progress", "print_table", "percentile"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def machine_info() -> dict[str, Any]:
    return {
        "kvbridge": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"machine": machine_info(), **payload}
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")
    return path


def bar_plot(
    path: Path,
    title: str,
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
) -> Path | None:
    """Grouped bar chart; returns None (and says why) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'kvbridge[bench]'); no plot written")
        return None
    bars = len(labels) * max(1, len(series))
    fig, ax = plt.subplots(figsize=(min(20.0, max(6.0, 2.0 + 0.25 * bars)), 5.0))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, values, width=width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A progress bar on stderr (tqdm when installed, else a counter); nothing at all when
    stderr is not a terminal, so logs and CI output get no carriage-return noise."""
    import sys

    if not sys.stderr.isatty():
        yield from items
        return
    try:
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total, leave=False)
        return
    except ImportError:
        pass
    for i, item in enumerate(items, 1):
        print(f"\r{desc}: {i}/{total if total is not None else '?'}", end="", file=sys.stderr)
        yield item
    print(file=sys.stderr)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Print rows as an aligned text table (floats to 3 significant digits)."""

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]

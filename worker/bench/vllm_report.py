"""The figures of ``kvbridge bench vllm``: per-request rows in, medians, spread and ratios out.

Pure (no vLLM, no engines): :mod:`kvbridge.worker.bench.vllm` measures one row per
request and one per round (a fresh engine pair); :func:`assemble` groups the rows by
(model, prompt length, connector), and :func:`box_plot` draws them. A row whose KV
did not arrive over the connector (a failed or missing load, a first token that
differs from prefill's) is a *problem*: a benchmark of recompute is worthless, so
problems are listed and the run is flagged untrustworthy. A load far slower than its
row's median (:data:`TAIL_FACTOR`) is a *tail*: listed, not a problem, so that a stall
the medians would hide is seen.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.worker.bench.report import percentile

__all__ = [
    "METRICS",
    "TAIL_FACTOR",
    "assemble",
    "box_plot",
    "problems",
    "ratios",
    "spread",
    "summarize",
    "tails",
]

log = logging.getLogger(__name__)

METRICS = ("decode_ttft_ms", "read_ms", "transfer_ms", "e2e_ms", "bytes")
"""Per request: decode's ``generate`` with ``max_tokens=1`` (transfer + first token, in the
engine); NIXL's own timing of the KV READ, post to completion (telemetry, the same span for
both connectors); the whole load as the engine saw it, the same span for both connectors
(from the ``start_load_kv`` that started it to the ``get_transfer_results`` that reported it
received; each row also keeps the connector's own figure as ``connector_ms``);
prefill + decode as the client saw them; and the KV bytes decode read (kvbridge's load
report, NixlConnector's ``bytes_transferred``)."""
BASELINE = "nixl"
"""Ratios are kvbridge's median over this connector's."""
TAIL_FACTOR = 3.0
"""A request whose whole load (``transfer_ms``) exceeds this many times its row's median is
listed under ``tails`` (the warm-up request, which pays the handshake, is never a row)."""
TABLE = (("decode_ttft_ms", "ttft"), ("read_ms", "read"), ("transfer_ms", "xfer"))
"""The metrics the printed table shows with median, p90 and max."""


def spread(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median, p10/p90, quartiles and min/max of ``values`` (None when there are none)."""
    if not values:
        return {"n": 0, "median": None, "p10": None, "p90": None, "q1": None, "q3": None,
                "min": None, "max": None}  # fmt: skip
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
        "q1": percentile(values, 25),
        "q3": percentile(values, 75),
        "min": min(values),
        "max": max(values),
    }


def _key(row: Mapping[str, Any]) -> tuple[str, str, str]:
    return (row["model"], row["prompts"], row["connector"])


def _good(row: Mapping[str, Any]) -> bool:
    return bool(row["loaded"]) and bool(row["same_first_token"])


def summarize(requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, prompt length, connector), in first-seen order: each metric's
    spread over every round's good requests and its median per round."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for row in requests:
        groups.setdefault(_key(row), []).append(row)
    out = []
    for (model, prompts, connector), rows in groups.items():
        good = [r for r in rows if _good(r)]
        rounds = sorted({r["round"] for r in rows})
        entry: dict[str, Any] = {
            "model": model,
            "prompts": prompts,
            "connector": connector,
            "requests": len(rows),
            "bad_requests": len(rows) - len(good),
            "prompt_tokens": spread([r["prompt_tokens"] for r in rows]),
        }
        for metric in METRICS:
            known = [r for r in good if r.get(metric) is not None]
            entry[metric] = spread([r[metric] for r in known])
            median, top = entry[metric]["median"], entry[metric]["max"]
            entry[metric]["max_over_median"] = top / median if median else None
            entry[metric]["round_medians"] = [
                statistics.median(vals) if vals else None
                for vals in ([r[metric] for r in known if r["round"] == i] for i in rounds)
            ]
        out.append(entry)
    return out


def ratios(summary: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each other connector's median over :data:`BASELINE`'s, per (model, prompt length) and
    metric (None where either median is missing), and the same of the p90s under
    ``<metric>_p90``; below 1 means it is faster."""
    by_key = {_key(s): s for s in summary}
    out = []
    for (model, prompts, connector), entry in by_key.items():
        base = by_key.get((model, prompts, BASELINE))
        if connector == BASELINE or base is None:
            continue
        row: dict[str, Any] = {"model": model, "prompts": prompts, "connector": connector}
        for metric in METRICS:
            for stat, name in (("median", metric), ("p90", f"{metric}_p90")):
                ours, theirs = entry[metric][stat], base[metric][stat]
                row[name] = ours / theirs if ours is not None and theirs else None
        out.append(row)
    return out


def tails(summary: Sequence[Mapping[str, Any]], requests: Sequence[Mapping[str, Any]]) -> list[str]:
    """Good requests whose ``transfer_ms`` exceeds :data:`TAIL_FACTOR` x their row's median."""
    medians = {_key(s): s["transfer_ms"]["median"] for s in summary}
    found = []
    for r in requests:
        median, value = medians.get(_key(r)), r.get("transfer_ms")
        if not _good(r) or value is None or not median or value <= TAIL_FACTOR * median:
            continue
        found.append(
            f"{r['model']} {r['prompts']} {r['connector']} round {r['round']} request "
            f"{r['index']}: transfer {value:.1f} ms = {value / median:.1f}x the row median "
            f"{median:.1f} ms"
        )
    return found


def problems(
    requests: Sequence[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Why the figures cannot be trusted: requests whose KV did not come over the connector
    or whose first token differs, and engine pairs that kept blocks after draining."""
    found = []
    for r in requests:
        where = f"{r['model']} {r['connector']} round {r['round']} request {r['index']}"
        if not r["loaded"]:
            found.append(f"{where}: no load ({r.get('error') or 'no transfer reported'})")
        if not r["same_first_token"]:
            found.append(f"{where}: decode's first token differs from prefill's")
    for rd in rounds:
        held = rd.get("blocks_held_after") or {}
        if any(held.values()):
            found.append(f"{rd['model']} {rd['connector']} round {rd['round']}: held {held}")
    return found


def assemble(
    settings: Mapping[str, Any],
    rounds: Sequence[Mapping[str, Any]],
    requests: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The JSON payload: settings, summary, ratios, problems, tails and every raw row."""
    summary = summarize(requests)
    found = problems(requests, rounds)
    return {
        "settings": dict(settings),
        "metrics": list(METRICS),
        "summary": summary,
        "ratios": ratios(summary),
        "problems": found,
        "tails": tails(summary, requests),
        "trustworthy": not found and bool(requests),
        "rounds": list(rounds),
        "requests": list(requests),
    }


def table_rows(payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Flat rows for :func:`~kvbridge.worker.bench.report.print_table`: median, p90 and max of
    decode TTFT, the KV READ and the whole load, so a tail cannot hide."""
    rows = []
    for s in payload["summary"]:
        row = {k: s[k] for k in ("model", "prompts", "connector")} | {"n": s["requests"]}
        for metric, short in TABLE:
            for stat in ("median", "p90", "max"):
                row[f"{short}_{stat}"] = s[metric][stat]
        row["e2e_median"] = s["e2e_ms"]["median"]
        row["kib_median"] = None if s["bytes"]["median"] is None else s["bytes"]["median"] / 1024
        row["bad"] = s["bad_requests"]
        rows.append(row)
    return rows


def box_plot(path: Path, payload: Mapping[str, Any]) -> Path | None:
    """Box plots (whiskers p10..p90, log scale) of decode TTFT, NIXL's READ time and the
    whole load (start_load_kv to reported) per (model, prompt length), one box per connector;
    None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'kvbridge[bench]'); no plot written")
        return None
    summary = payload["summary"]
    groups = list(dict.fromkeys((s["model"], s["prompts"]) for s in summary))
    connectors = list(dict.fromkeys(s["connector"] for s in summary))
    good = [r for r in payload["requests"] if _good(r)]
    fig, axes = plt.subplots(1, 3, figsize=(max(12.0, 3.3 * len(groups) + 6), 4.8))
    width = 0.8 / max(1, len(connectors))
    panels = (
        ("decode_ttft_ms", "decode TTFT"),
        ("read_ms", "KV READ (NIXL telemetry)"),
        ("transfer_ms", "whole load: start_load_kv to reported"),
    )
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for i, conn in enumerate(connectors):
            data = [
                [
                    r[metric]
                    for r in good
                    if (r["model"], r["prompts"], r["connector"]) == (*g, conn)
                    and r.get(metric) is not None
                ]
                or [float("nan")]
                for g in groups
            ]
            box = ax.boxplot(
                data,
                positions=[x + (i - (len(connectors) - 1) / 2) * width for x in range(len(groups))],
                widths=width * 0.9,
                whis=(10, 90),
                patch_artist=True,
                showfliers=True,
                medianprops={"color": "black"},
            )
            color = f"C{i}"
            for patch in box["boxes"]:
                patch.set_facecolor(color)
                patch.set_alpha(0.6)
            ax.plot([], [], color=color, linewidth=6, alpha=0.6, label=conn)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{p}" for m, p in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms per request (log)")
        ax.set_title(f"{title} (box: IQR, whiskers: p10-p90)", fontsize=9)
        ax.legend(fontsize=8)
    loads = [rd["loadavg_before"][0] for rd in payload["rounds"] if rd.get("loadavg_before")]
    span = f"{min(loads):.2f}..{max(loads):.2f}" if loads else "?"
    fig.suptitle(
        f"vLLM P/D on CPU: kvbridge vs NixlConnector, {len(payload['rounds'])} engine pairs, "
        f"1-min load before each {span}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

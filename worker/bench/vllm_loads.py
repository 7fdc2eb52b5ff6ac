"""What ``kvbridge bench vllm`` reads about each load from the decode engine's ``stats``.

Used by :mod:`kvbridge.worker.bench.vllm`, per request (:meth:`Loads.take`) or per burst
(:meth:`Loads.take_all`); the engine harness that answers ``stats`` is
:mod:`kvbridge.worker.vllm.instance`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Loads"]


class Loads:
    """What the decode's ``stats`` says about the request just served: its whole load as the
    engine saw it, whether the KV came over the connector, and why not.

    ``transfer_ms`` is the same span for every connector, timed by the engine harness
    (:mod:`kvbridge.worker.vllm.instance`): from the ``start_load_kv`` that started the load
    to the ``get_transfer_results`` that reported it received. ``connector_ms`` is the
    connector's own figure (kvbridge: its load report, from the load's start to its
    verdict; NixlConnector: NIXL's telemetry of the READ, as ``read_ms``)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.detail: dict[str, Any] = {}
        """The last request's descriptors (and kvbridge's bytes, load path and steps)."""

    def take(self, stats: dict[str, Any]) -> tuple[float | None, bool, str | None]:
        self.detail = {}
        spans = list((stats.get("load_spans") or {}).values())
        span = spans[0] if len(spans) == 1 else None
        if "loads" in stats:  # kvbridge: one new load result per request
            new = [v for k, v in stats["loads"].items() if k not in self.seen]
            self.seen.update(stats["loads"])
            if len(new) != 1:
                return None, False, f"{len(new)} new kvbridge load results"
            self.detail, _, loaded, error = self.one(new[0])
            return span, loaded, error
        durations = stats.get("nixl_transfer_s") or []
        posts = stats.get("nixl_post_s") or []
        # NixlConnector's figures are NIXL's telemetry: descriptors after merging, the READ
        merged = sum(stats.get("nixl_descriptors") or [])
        self.detail = {
            "descriptors": merged,
            "wire_descriptors": merged,
            "read_ms": 1e3 * sum(durations) if durations else None,
            "post_ms": 1e3 * sum(posts) if posts else None,
            "connector_ms": 1e3 * sum(durations) if durations else None,
        }
        self.detail["bytes"] = sum(stats.get("nixl_bytes") or []) or None
        if stats.get("nixl_failed"):
            return None, False, f"{stats['nixl_failed']} NixlConnector failed transfers"
        if not durations:
            return None, False, "no NixlConnector transfer reported"
        return span, True, None

    @staticmethod
    def one(load: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool, str | None]:
        """``(detail, kvbridge's own figure, loaded, error)`` of one kvbridge load result."""
        keys = ("descriptors", "wire_descriptors", "bytes", "path", "read_ms", "post_ms")
        detail = {k: load.get(k) for k in (*keys, "link_ms", "steps")}
        detail["connector_ms"] = load["transfer_ms"]
        if load["error"] or not load["moved"]:
            return detail, load["transfer_ms"], False, load["error"] or "no block moved"
        return detail, float(load["transfer_ms"]), True, None

    def take_all(self, stats: dict[str, Any], n: int) -> list[dict[str, Any]]:
        """The ``n`` loads of a burst (in the order the connector reports them, which need
        not be the prompts' order): their figures, as rows' fields."""
        spans: dict[str, float] = stats.get("load_spans") or {}
        if "loads" in stats:
            new = {k: v for k, v in stats["loads"].items() if k not in self.seen}
            self.seen.update(stats["loads"])
            if len(new) != n:
                error = f"{len(new)} new kvbridge load results for {n} prompts"
                return [{"transfer_ms": None, "loaded": False, "error": error}] * n
            out = []
            for rid, load in new.items():
                detail, _, loaded, why = self.one(load)
                span = spans.get(rid)
                out.append(detail | {"transfer_ms": span, "loaded": loaded, "error": why})
            return out
        durations = stats.get("nixl_transfer_s") or []
        if stats.get("nixl_failed") or len(durations) != n:
            error = f"{len(durations)} NixlConnector transfers, {stats.get('nixl_failed')} failed"
            return [{"transfer_ms": None, "loaded": False, "error": error}] * n
        ordered = list(spans.values()) if len(spans) == n else [None] * n
        return [
            {
                "transfer_ms": span,
                "read_ms": 1e3 * d,
                "connector_ms": 1e3 * d,
                "loaded": True,
                "error": None,
            }
            for d, span in zip(durations, ordered, strict=True)
        ]

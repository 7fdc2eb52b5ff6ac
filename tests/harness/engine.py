"""Driving the reference engine in-process to the end of its requests."""

from __future__ import annotations

from kvbridge.worker.engine import Engine, RequestOutput


def run_to_end(engine: Engine) -> dict[str, RequestOutput]:
    """Step until nothing is unfinished; each request's final output by id."""
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final

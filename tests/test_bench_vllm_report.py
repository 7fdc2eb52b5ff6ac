"""``kvbridge bench vllm``'s figures from hand-made rows: medians, spread, ratios, flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker.bench.vllm_report import (
    assemble,
    box_plot,
    spread,
    summarize,
    table_rows,
)


def row(connector: str, rnd: int, index: int, ttft: float, **over: Any) -> dict[str, Any]:
    return {
        "model": "4L",
        "prompts": "short",
        "connector": connector,
        "round": rnd,
        "index": index,
        "prompt_tokens": 100 + index,
        "decode_ttft_ms": ttft,
        "read_ms": ttft / 20,
        "transfer_ms": ttft / 10,
        "e2e_ms": ttft + 100,
        "loaded": True,
        "error": None,
        "same_first_token": True,
    } | over


def rounds_of(n: int, held: int = 0) -> list[dict[str, Any]]:
    return [
        {"round": r, "model": "4L", "connector": c, "loadavg_before": [1.0 + r, 1, 1],
         "loadavg_after": [1.5, 1, 1], "blocks_held_after": {"prefill": held, "decode": 0}}
        for r in range(n) for c in ("kvbridge", "nixl")
    ]  # fmt: skip


def test_spread_of_ten_values() -> None:
    s = spread([float(v) for v in range(10, 0, -1)])
    assert s == {"n": 10, "median": 5.5, "p10": 2.0, "p90": 9.0, "q1": 3.0, "q3": 8.0,
                 "min": 1.0, "max": 10.0}  # fmt: skip


def test_spread_of_nothing_is_none_not_an_error() -> None:
    assert spread([])["median"] is None


def test_summary_pools_rounds_and_keeps_each_rounds_median() -> None:
    rows = [row("kvbridge", 0, i, t) for i, t in enumerate([10, 20, 30])]
    rows += [row("kvbridge", 1, i, t) for i, t in enumerate([40, 50, 60])]
    (entry,) = summarize(rows)
    assert entry["decode_ttft_ms"]["median"] == 35
    assert entry["decode_ttft_ms"]["round_medians"] == [20, 50]
    assert entry["transfer_ms"]["median"] == 3.5
    assert entry["read_ms"]["median"] == 1.75
    assert (entry["requests"], entry["bad_requests"]) == (6, 0)


def test_a_request_without_a_read_time_counts_for_every_other_metric() -> None:
    rows = [row("kvbridge", 0, 0, 10.0), row("kvbridge", 0, 1, 20.0, read_ms=None)]
    (entry,) = summarize(rows)
    assert (entry["decode_ttft_ms"]["n"], entry["read_ms"]["n"]) == (2, 1)
    assert entry["read_ms"]["round_medians"] == [0.5]


def test_ratios_are_kvbridge_over_nixl_per_metric() -> None:
    rows = [row("kvbridge", 0, i, 30.0) for i in range(3)]
    rows += [row("nixl", 0, i, 20.0) for i in range(3)]
    payload = assemble({"rounds": 1}, rounds_of(1), rows)
    (ratio,) = payload["ratios"]
    assert ratio["decode_ttft_ms"] == pytest.approx(1.5)
    assert ratio["e2e_ms"] == pytest.approx(130 / 120)
    assert payload["trustworthy"] and payload["problems"] == []


def test_every_kvbridge_variant_gets_its_own_ratio_over_nixl() -> None:
    rows = [row("kvbridge", 0, 0, 30.0), row("nixl", 0, 0, 20.0), row("kvbridge-blhnc", 0, 0, 10.0)]
    payload = assemble({"rounds": 1}, rounds_of(1), rows)
    got = {r["connector"]: r["decode_ttft_ms"] for r in payload["ratios"]}
    assert got == {"kvbridge": pytest.approx(1.5), "kvbridge-blhnc": pytest.approx(0.5)}


def test_a_recomputed_request_is_left_out_of_the_figures_and_flags_the_run() -> None:
    rows = [row("kvbridge", 0, 0, 10.0), row("kvbridge", 0, 1, 9999.0, loaded=False,
            error="kvbridge load timed out", transfer_ms=None)]  # fmt: skip
    rows += [row("nixl", 0, i, 20.0) for i in range(2)]
    payload = assemble({}, rounds_of(1), rows)
    kvb = next(s for s in payload["summary"] if s["connector"] == "kvbridge")
    assert kvb["decode_ttft_ms"]["median"] == 10.0 and kvb["bad_requests"] == 1
    assert not payload["trustworthy"]
    assert payload["problems"] == [
        "4L kvbridge round 0 request 1: no load (kvbridge load timed out)"
    ]


def test_a_wrong_first_token_or_held_blocks_flag_the_run() -> None:
    rows = [row("nixl", 0, 0, 20.0, same_first_token=False), row("kvbridge", 0, 0, 10.0)]
    payload = assemble({}, rounds_of(1, held=3), rows)
    assert not payload["trustworthy"]
    assert any("first token differs" in p for p in payload["problems"])
    assert any("held {'prefill': 3" in p for p in payload["problems"])


def test_an_empty_run_is_not_trustworthy() -> None:
    assert not assemble({}, [], [])["trustworthy"]


def test_payload_is_json_and_the_table_and_plot_come_from_it(tmp_path: Path) -> None:
    rows = [row(c, r, i, 10.0 * (i + 1) * (2 if c == "nixl" else 1), prompts=p)
            for c in ("kvbridge", "nixl") for r in range(2) for i in range(3)
            for p in ("short", "long")]  # fmt: skip
    payload = json.loads(json.dumps(assemble({"rounds": 2}, rounds_of(2), rows)))
    table = table_rows(payload)
    assert [(t["prompts"], t["connector"]) for t in table] == [
        ("short", "kvbridge"),
        ("long", "kvbridge"),
        ("short", "nixl"),
        ("long", "nixl"),
    ]
    assert table[0]["ttft_median"] == 20.0 and table[0]["ttft_p90"] == 30.0
    assert [r["decode_ttft_ms"] for r in payload["ratios"]] == [0.5, 0.5]
    pytest.importorskip("matplotlib")
    png = box_plot(tmp_path / "b.png", payload)
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_the_table_shows_p90_and_max_beside_each_median() -> None:
    ttfts = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 100.0]
    rows = [row("kvbridge", 0, i, t) for i, t in enumerate(ttfts)]
    (line,) = table_rows(assemble({}, rounds_of(1), rows))
    assert (line["ttft_median"], line["ttft_p90"], line["ttft_max"]) == (14.5, 18.0, 100.0)
    assert (line["read_median"], line["read_max"]) == (0.725, 5.0)
    xfer = (line["xfer_median"], line["xfer_p90"], line["xfer_max"])
    assert xfer == pytest.approx((1.45, 1.8, 10.0))
    assert "ttft_p10" not in line


def test_one_stalled_load_among_fast_ones_is_listed_as_a_tail() -> None:
    rows = [row("kvbridge", 0, i, 80.0) for i in range(12)]  # transfer 8 ms each
    rows[5]["transfer_ms"] = 55.0
    rows += [row("kvbridge", 1, i, 80.0) for i in range(4)]
    rows += [row("nixl", 0, i, 80.0, transfer_ms=0.5 + i) for i in range(4)]
    payload = assemble({}, rounds_of(2), rows)
    kvb = next(s for s in payload["summary"] if s["connector"] == "kvbridge")
    assert kvb["transfer_ms"]["median"] == 8.0 and kvb["transfer_ms"]["max"] == 55.0
    assert kvb["transfer_ms"]["max_over_median"] == pytest.approx(55 / 8)
    assert payload["tails"] == [
        "4L short kvbridge round 0 request 5: transfer 55.0 ms = 6.9x the row median 8.0 ms"
    ]
    assert payload["trustworthy"]  # a tail is shown, not a reason to distrust the run
    (ratio,) = payload["ratios"]
    assert ratio["transfer_ms"] == pytest.approx(8.0 / 2.0)
    assert ratio["transfer_ms_p90"] == pytest.approx(8.0 / 3.5)  # kvbridge's p90 is 8 ms


def test_loads_within_three_times_the_median_are_no_tail() -> None:
    rows = [row("kvbridge", 0, i, 10.0 * (1 + i % 3)) for i in range(9)]  # 1, 2, 3 ms
    payload = assemble({}, rounds_of(1), rows)
    assert payload["tails"] == []


def test_bytes_moved_are_summarized_and_ratioed_against_nixl() -> None:
    rows = [row("kvbridge", 0, i, 10.0, bytes=160 * 1024) for i in range(2)]
    rows += [row("nixl", 0, i, 10.0, bytes=200 * 1024) for i in range(2)]
    payload = assemble({}, rounds_of(1), rows)
    (ratio,) = payload["ratios"]
    assert ratio["bytes"] == pytest.approx(0.8)
    kib = {r["connector"]: r["kib_median"] for r in table_rows(payload)}
    assert kib == {"kvbridge": 160.0, "nixl": 200.0}


def test_nixl_connectors_bytes_come_from_its_stats() -> None:
    from kvbridge.worker.bench.vllm_loads import Loads

    loads = Loads()
    took = loads.take({"nixl_transfer_s": [0.002], "nixl_descriptors": [4],
                       "nixl_bytes": [65536, 32768], "nixl_failed": 0,
                       "load_spans": {"r1": 3.5}})  # fmt: skip
    assert took == (3.5, True, None) and loads.detail["bytes"] == 98304
    assert loads.detail["read_ms"] == loads.detail["connector_ms"] == 2.0


def test_the_whole_load_is_the_engine_harness_span_for_every_connector() -> None:
    """``transfer_ms`` is the same span for both connectors (start_load_kv to reported, timed
    by the engine harness); each connector's own figure is kept as ``connector_ms``."""
    from kvbridge.worker.bench.vllm_loads import Loads

    loads = Loads()
    load = {"transfer_ms": 1.5, "error": "", "moved": 4, "read_ms": 0.5, "steps": [["start", 0]]}
    took = loads.take({"loads": {"r1": load}, "load_spans": {"r1": 2.5}})
    assert took == (2.5, True, None)
    assert loads.detail["connector_ms"] == 1.5 and loads.detail["steps"] == [["start", 0]]
    # a load the harness did not see reported has no whole-load figure (not the connector's)
    assert loads.take({"loads": {"r1": load, "r2": load}}) == (None, True, None)
    burst = loads.take_all({"loads": {"a": load, "b": load}, "load_spans": {"b": 4.0, "a": 3.0}}, 2)
    assert [r["transfer_ms"] for r in burst] == [3.0, 4.0]
    nixl = {"nixl_transfer_s": [0.001, 0.002], "load_spans": {"x": 5.0, "y": 6.0}}
    assert [r["transfer_ms"] for r in loads.take_all(nixl, 2)] == [5.0, 6.0]

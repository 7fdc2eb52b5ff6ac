"""kvbridge's KV layout inside real vLLM (CPU): block-outermost ``BLHNC`` and ``LBHNC``.

Five engines: a prefill and a decode per layout and one plain engine; the
``LBHNC`` pair and the plain engine are the session's ``vllm_pair`` (shared with
test_vllm_pd), the ``BLHNC`` pair starts once for the module. vLLM's CPU
backend declares only ``LBHNC``; the ``BLHNC`` engines use the driver's
test-only shim (``cpu_kv_layouts``) so that the connector's default request for
``BLHNC`` is honoured. The ``LBHNC`` engines ask for ``BLHNC`` too (the default)
and get vLLM's fallback. Every P/D pair must give the plain engine's
greedy tokens (which depend on the first prompt token), moving 1 descriptor per
block when both sides are block-outermost and one per (layer, K/V) span otherwise.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import SharedPair, model_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

LAYOUTS = {"BLHNC": ("BLHNC", "LBHNC"), "LBHNC": ()}
"""Layout each pair runs under -> the layouts the shim makes the CPU backend declare."""
ORDERS = {"BLHNC": "B L KV N H C", "LBHNC": "L B KV N H C"}
NUM_LAYERS = 4  # the tiny Llama's
PAIRS = [(p, d) for p in LAYOUTS for d in LAYOUTS]
MAX_TOKENS = 8
BODY = list(range(10, 80))


def _prompts(first: int) -> list[list[int]]:
    """Two prompts of 3 blocks each whose first token is unique to one pair."""
    return [[first, *BODY, 100 + i, 100 + i, 100 + i] for i in range(2)]


SHARED = {"prefill-LBHNC": "prefill", "decode-LBHNC": "decode", "plain": "plain"}
"""This module's names of the session pair's engines."""
NAMES = ["prefill-BLHNC", "decode-BLHNC", *SHARED]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-layout")


@pytest.fixture(scope="module")
def ports(tmp: Path, vllm_pair: SharedPair) -> dict[str, int]:
    base = 19000 + (hash(str(tmp)) % 2000)  # str hash: varies per run, that is the point
    return {"BLHNC": base, "LBHNC": vllm_pair.port}


class _Engines(dict[str, harness.Engine]):
    """The module's BLHNC pair; the LBHNC pair and the plain engine are looked up in the
    session pair on every use (a test elsewhere may have killed and restarted its prefill)."""

    def __init__(self, own: dict[str, harness.Engine], pair: SharedPair) -> None:
        super().__init__(own)
        self.pair = pair

    def __missing__(self, key: str) -> harness.Engine:
        return self.pair.engines[SHARED[key]]


@pytest.fixture(scope="module")
def engines(
    tmp: Path, ports: dict[str, int], vllm_pair: SharedPair
) -> Iterator[dict[str, harness.Engine]]:
    model = model_or_skip(tmp)
    shim = LAYOUTS["BLHNC"]
    kv = harness.kv_config("kvbridge", "kv_producer", control_port=ports["BLHNC"])
    started = {
        "prefill-BLHNC": harness.Engine(
            model, core=0, kv=kv, log=tmp / "prefill-BLHNC.log", wait=False, cpu_kv_layouts=shim
        ),
        "decode-BLHNC": harness.Engine(
            model,
            core=1,
            kv=harness.kv_config("kvbridge", "kv_consumer", load_timeout_s=5),
            log=tmp / "decode-BLHNC.log",
            wait=False,
            cpu_kv_layouts=shim,
        ),
    }
    with harness.running(started) as own:
        yield _Engines(own, vllm_pair)


def _decode_log(engines: dict[str, harness.Engine], name: str) -> str:
    log = engines[f"decode-{name}"].log
    assert log is not None
    return log.read_text()


def _pd(
    engines: dict[str, harness.Engine], src: str, dst: str, prompts: list[list[int]]
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """P/D from ``src``'s prefill to ``dst``'s decode; the tokens and the decode's new loads."""
    decode = engines[f"decode-{dst}"]
    before = set(decode.call(cmd="stats")["loads"])
    pre = engines[f"prefill-{src}"].generate(
        prompts, 1, [{"do_remote_decode": True}] * len(prompts)
    )
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    assert all(p and p["remote_address"] for p in params), params
    got = harness.tokens(decode.generate(prompts, MAX_TOKENS, params))
    loads = [v for k, v in decode.call(cmd="stats")["loads"].items() if k not in before]
    return got, loads


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_engine_registered_the_layout_it_asked_for(
    engines: dict[str, harness.Engine], name: str
) -> None:
    for role in ("prefill", "decode"):
        lay = engines[f"{role}-{name}"].call(cmd="stats")["layout"]
        assert lay["order"] == ORDERS[name], lay
        assert lay["regions"] == 1, lay  # LBHNC: vLLM's one buffer is one region too
        assert lay["descriptors_per_block"] == (1 if name == "BLHNC" else 2 * NUM_LAYERS)
        assert lay["model"].endswith("|vllm-packed-kv"), lay


def test_plain_output_depends_on_the_first_token(engines: dict[str, harness.Engine]) -> None:
    plain = engines["plain"]
    outs = [harness.tokens(plain.generate(_prompts(i + 1)[:1], MAX_TOKENS)) for i in range(2)]
    assert outs[0] != outs[1]


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{p}-to-{d}" for p, d in PAIRS])
def test_pd_between_layouts_gives_the_plain_tokens(
    engines: dict[str, harness.Engine], tmp: Path, ports: dict[str, int], src: str, dst: str
) -> None:
    prompts = _prompts(1 + PAIRS.index((src, dst)))
    expected = harness.tokens(engines["plain"].generate(prompts, MAX_TOKENS))
    got, loads = _pd(engines, src, dst, prompts)
    assert got == expected
    assert len(loads) == len(prompts)
    assert all(not x["error"] and x["moved"] == 3 for x in loads), loads
    whole = src == dst == "BLHNC"
    per_block = 1 if whole else 2 * NUM_LAYERS
    assert all(x["descriptors"] == per_block * x["moved"] for x in loads), loads
    mode = "whole_block" if whole else "per_span"
    assert f"at 127.0.0.1:{ports[src]} ({mode}, warm-up READ" in _decode_log(engines, dst)


def test_load_figures_per_layout(engines: dict[str, harness.Engine], tmp: Path) -> None:
    """Same prompts, one load at a time, per same-layout pair (printed, kept as JSON)."""
    prompts = [[50 + i, *range(200, 455)] for i in range(6)]  # 256 tokens: 8 blocks
    figures = {}
    for name in LAYOUTS:
        loads = []
        for p in prompts:
            _, new = _pd(engines, name, name, [p])
            loads += new
        assert all(not x["error"] and x["moved"] >= 7 for x in loads), loads
        ms = [float(x["transfer_ms"]) for x in loads]
        figures[name] = {
            "descriptors_per_block": loads[0]["descriptors"] // loads[0]["moved"],
            "blocks": loads[0]["moved"],
            "bytes": loads[0]["bytes"],
            "transfer_ms_median": statistics.median(ms),
            "transfer_ms": ms,
        }
    (tmp / "figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    assert figures["BLHNC"]["descriptors_per_block"] == 1
    assert figures["LBHNC"]["descriptors_per_block"] == 2 * NUM_LAYERS


def test_nothing_is_held_afterwards(engines: dict[str, harness.Engine]) -> None:
    for key in [k for k in NAMES if k != "plain"]:
        st = engines[key].call(cmd="drain", timeout_s=10)
        assert st["blocks_in_use"] == 0 and st["requests"] == 0, (key, st)
        assert st["held_requests"] == 0 and st["leases"] == 0, (key, st)

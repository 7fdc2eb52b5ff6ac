"""A serving node's Prometheus transfer metrics: what one finished request adds, and a real
scrape over HTTP on loopback after a prefill/decode run between two node processes."""

from __future__ import annotations

import argparse
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.connector import LoadResult
from kvbridge.proto import BlockId, RequestId, codec
from kvbridge.worker.engine import RequestOutput
from kvbridge.worker.serving.metrics import (
    LOAD_FAILURE_REASONS,
    METRICS,
    NodeMetrics,
    failure_reason,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def local(metrics: NodeMetrics) -> Samples:
    from prometheus_client import generate_latest

    return parse(generate_latest(metrics.registry).decode())


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse(resp.read().decode())


def blocks(samples: Samples, source: str) -> float:
    return samples[("kvbridge_blocks_total", (("source", source),))]


def failures(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "kvbridge_load_failures_total" and v
    }


def output(rid: str, local_hit: int = 0, recomputed: int = 0) -> RequestOutput:
    return RequestOutput(
        RequestId(rid), (1,), (1,), True, "length", None, 64, local_hit, 0, recomputed, 64, 0.01
    )


def test_a_finished_request_moves_the_counters_by_its_load() -> None:
    leases = [3]
    metrics = NodeMetrics(lambda: leases[0])
    load = LoadResult(RequestId("r"), 4, 3, (), 12.5, "", {"self": 3}, 3 * 4096, 1)
    metrics.observe(output("r", local_hit=2), load)
    got = local(metrics)
    assert blocks(got, "moved") == 3
    assert blocks(got, "offload") == 1
    assert blocks(got, "local_hit") == 2
    assert blocks(got, "recomputed") == 0
    assert got[("kvbridge_transfer_bytes_total", ())] == 3 * 4096
    assert got[("kvbridge_transfer_seconds_count", ())] == 1
    assert got[("kvbridge_transfer_seconds_sum", ())] == pytest.approx(0.0125)
    assert got[("kvbridge_leases_held", ())] == 3
    assert failures(got) == {}
    leases[0] = 0
    assert local(metrics)[("kvbridge_leases_held", ())] == 0, "read at scrape time"


def test_a_request_without_a_load_counts_only_its_local_blocks() -> None:
    metrics = NodeMetrics(lambda: 0)
    metrics.observe(output("p", local_hit=1, recomputed=0), None)
    got = local(metrics)
    assert blocks(got, "local_hit") == 1
    assert got[("kvbridge_transfer_seconds_count", ())] == 0


def test_a_failed_load_is_counted_by_a_bounded_reason() -> None:
    metrics = NodeMetrics(lambda: 0)
    bad = (BlockId(0), BlockId(1))
    metrics.observe(
        output("a", recomputed=2), LoadResult(RequestId("a"), 2, 0, bad, 5.0, "peer said: x" * 50)
    )
    metrics.observe(
        output("b", recomputed=1),
        LoadResult(
            RequestId("b"), 2, 1, bad[1:], 5.0, "lease gone (expired or released): partial prefix"
        ),
    )
    got = local(metrics)
    assert failures(got) == {"other": 1, "lease_expired": 1}
    assert blocks(got, "recomputed") == 3
    reasons = {dict(labels)["reason"] for (n, labels) in got if n == "kvbridge_load_failures_total"}
    assert reasons == set(LOAD_FAILURE_REASONS), "every reason is exposed from the start, at 0"


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("lease expired: partial prefix", "lease_expired"),
        ("lease gone (expired or released): partial prefix", "lease_expired"),
        ("cross blocks no longer held by the peer", "cross_blocks_gone"),
        ("READ of 4 blocks did not finish before its deadline", "timeout"),
        ("Pin: failed to connect to all addresses; last error: UNAVAILABLE", "peer_unreachable"),
        (
            "Heartbeat 127.0.0.1:1: failed to connect to all addresses; last error: UNKNOWN: "
            "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
            "peer_unreachable",
        ),
        ("missing or wrong kvbridge token", "auth"),
        ("something new", "other"),
    ],
)
def test_load_errors_map_to_one_reason_each(error: str, reason: str) -> None:
    assert failure_reason(error) == reason
    assert reason in LOAD_FAILURE_REASONS


def test_every_documented_node_family_is_registered() -> None:
    families = {f.name for f in NodeMetrics(lambda: 0).registry.collect()}
    assert families == {name.removesuffix("_total") for name in METRICS}


# ----- real nodes ---------------------------------------------------------------------------
Nodes = tuple[dict[str, dict[str, str]], dict[str, "subprocess.Popen[bytes]"]]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    """A prefill and a decode ``kvbridge serve`` process, each with ``--metrics-port 0``."""
    from kvbridge.worker.serving import start_node

    args = argparse.Namespace(
        model="tiny", block_size=16, num_blocks=128, seed=0, on_load_error="recompute",
        startup_timeout=90.0,
    )  # fmt: skip
    with ExitStack() as stack:
        info, procs = {}, {}
        for role in ("prefill", "decode"):
            procs[role], info[role] = stack.enter_context(
                start_node(role, args, "block-nhd", tmp_path, None, ["--metrics-port", "0"])
            )
        yield info, procs


@pytest.mark.slow
def test_scrape_after_a_pd_run_shows_moved_blocks_and_a_load_failure(nodes: Nodes) -> None:
    from kvbridge.worker.serving import EngineClient, Router
    from kvbridge.worker.tools import check_no_leaks, make_workload

    info, procs = nodes
    with (
        closing(EngineClient(info["prefill"]["inference"], 60)) as prefill,
        closing(EngineClient(info["decode"]["inference"], 60)) as decode,
    ):
        router = Router(prefill, decode)
        assert blocks(scrape(info["decode"]["metrics"]), "moved") == 0

        prompts = make_workload(3, 1, 512, 16, seed=3)
        results = [router.generate(p, 3, f"r{i}") for i, p in enumerate(prompts)]
        assert check_no_leaks({"prefill": prefill, "decode": decode}) == []
        after = scrape(info["decode"]["metrics"])
        moved = sum(r.decode.blocks_moved for r in results)
        assert moved > 0
        assert blocks(after, "moved") == moved
        assert blocks(after, "local_hit") == sum(r.decode.blocks_local_hit for r in results)
        assert after[("kvbridge_transfer_seconds_count", ())] == len(prompts)
        nbytes = sum(r.decode.bytes_moved for r in results)
        assert after[("kvbridge_transfer_bytes_total", ())] == nbytes > 0
        assert failures(after) == {}
        assert scrape(info["prefill"]["metrics"])[("kvbridge_leases_held", ())] == 0

        # prefill pins a request's blocks for a decode that has not come yet: one lease held
        prompt = prompts[0] + [7] * 40
        first = prefill.generate(prompt, 1, "held", {"do_remote_decode": True})
        assert scrape(info["prefill"]["metrics"])[("kvbridge_leases_held", ())] == 1
        # prefill dies before decode reads: the load fails and the request is recomputed
        procs["prefill"].kill()
        procs["prefill"].wait()
        params = codec.unpack(first.kv_transfer_params, "KVTransferParams")
        rest = decode.generate(prompt + list(first.token_ids), 2, "held", params)
        assert rest.stats.load_error
        final = scrape(info["decode"]["metrics"])
        assert failures(final) == {"peer_unreachable": 1}, rest.stats.load_error
        recomputed = blocks(after, "recomputed") + rest.stats.blocks_recomputed
        assert blocks(final, "recomputed") == recomputed > 0
        assert blocks(final, "moved") == moved

"""kvbridge inside real vLLM (CPU), seen from vLLM: overlapping loads, its log lines, its stats.

A prefill and a decode engine with kvbridge and vLLM's stat loggers on (an
offline engine leaves them off; ``--log-stats``). The prefill is stopped
(SIGSTOP) while the decode's loads wait for their handshake: every load of the
step must then be in flight at once (``max_concurrent_loads`` defaults to 4),
all behind the one handshake. vLLM's log (``VLLM_LOGGING_STREAM`` goes to the
engine's log file) must carry kvbridge's INFO lines once each in vLLM's format
and vLLM's ``KV Transfer metrics`` line; its Prometheus registry (what
``/metrics`` serves) must count exactly the loads the decode reports.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.worker import vllm as harness
from tests.harness.vllm import model_or_skip, pd_trio

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPTS = [[3 + i, *range(20 + i, 90 + i)] for i in range(4)]  # 71 tokens each, 3 blocks
MAX_TOKENS = 4
STALL_S = 1.5
"""How long the prefill stays stopped once the decode's handshake reached it."""


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path]]:
    tmp = tmp_path_factory.mktemp("vllm-obs")
    model = model_or_skip(tmp)
    port = 19000 + (hash(str(tmp)) % 2000)
    env = {"VLLM_LOG_STATS_INTERVAL": "0.001"}  # log at every step with outputs
    started = pd_trio(model, tmp, port, plain=False, wait=False, log_stats=True, env=env)
    with harness.running(started) as engines:
        yield {**engines, "port": port}, tmp


def _connected_to(port: int) -> bool:
    """Whether a TCP connection to ``port`` on this host is established (the kernel accepts
    it even while the listening process is stopped)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                return True
    return False


@pytest.fixture(scope="module")
def overlapped(pd: tuple[dict[str, Any], Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One step of loads from a prefill stopped while the decode's first handshake reached
    it: the decode's answer and those loads. Made once, by whichever test asks first, so the
    tests that read the decode's figures find these loads in any order."""
    engines, _ = pd
    prefill, decode = engines["prefill"], engines["decode"]
    pre = prefill.generate(PROMPTS, 1, [{"do_remote_decode": True}] * len(PROMPTS))
    params = [o["kv_transfer_params"] for o in pre["outputs"]]
    answer: list[dict[str, Any]] = []
    prefill.child.send_signal(signal.SIGSTOP)
    try:
        loading = threading.Thread(
            target=lambda: answer.append(decode.generate(PROMPTS, MAX_TOKENS, params))
        )
        loading.start()
        deadline = time.monotonic() + 120
        while not _connected_to(engines["port"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _connected_to(engines["port"]), "the decode never dialled the prefill"
        time.sleep(STALL_S)  # the stall under test: every load of the step waits through it
    finally:
        prefill.child.send_signal(signal.SIGCONT)
    loading.join(300)
    assert answer, "the decode did not answer"
    return answer[0], list(decode.call(cmd="stats")["loads"].values())


def test_a_steps_loads_overlap_behind_one_handshake(
    pd: tuple[dict[str, Any], Path], overlapped: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    _, tmp = pd
    answer, loads = overlapped
    assert all(len(t) == MAX_TOKENS for t in harness.tokens(answer))
    assert len(loads) == len(PROMPTS) and all(not x["error"] for x in loads), loads
    # each load began before the prefill resumed: all four were in flight at once
    assert all(x["transfer_ms"] >= STALL_S * 1e3 for x in loads), loads
    log = (tmp / "decode.log").read_text()
    assert len(re.findall(r"connected to \S+ at 127\.0\.0\.1:", log)) == 1, log[-3000:]


def test_kvbridge_info_lines_are_in_vllms_log_once_in_its_format(
    pd: tuple[dict[str, Any], Path],
) -> None:
    _, tmp = pd
    for name in ("prefill", "decode"):
        log = (tmp / f"{name}.log").read_text()
        lines = [x for x in log.splitlines() if "kvbridge registered vLLM's KV cache" in x]
        assert len(lines) == 1, (name, lines, log[-3000:])
        # vLLM's format: "(EngineCore pid=N) INFO 11-23 15:00:00 [worker.py:123] message"
        assert re.search(r"pid=\d+\) INFO \S+ \S+ \[worker\.py:\d+\] kvbridge", lines[0])


def _metric(text: str, name: str) -> float:
    values = [float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)]
    assert len(values) == 1, (name, values)
    return values[0]


def test_vllms_log_line_and_prometheus_count_the_loads_kvbridge_made(
    pd: tuple[dict[str, Any], Path], overlapped: tuple[dict[str, Any], list[dict[str, Any]]]
) -> None:
    engines, tmp = pd
    loads = list(engines["decode"].call(cmd="stats")["loads"].values())
    assert loads == overlapped[1]
    log = (tmp / "decode.log").read_text()
    lines = re.findall(r"KV Transfer metrics: (.*)", log)
    counted = sum(int(m) for x in lines for m in re.findall(r"Num successful transfers=(\d+)", x))
    assert counted == len(loads), lines
    assert all("Avg blocks per transfer=" in x for x in lines), lines
    text = engines["decode"].call(cmd="metrics")["text"]
    assert _metric(text, "vllm:kvbridge_xfer_time_seconds_count") == len(loads)
    assert _metric(text, "vllm:kvbridge_num_blocks_sum") == sum(x["moved"] for x in loads)
    assert _metric(text, "vllm:kvbridge_bytes_transferred_sum") == sum(x["bytes"] for x in loads)
    assert _metric(text, "vllm:kvbridge_num_failed_transfers_total") == 0

"""The soak: 2 prefill + 2 decode nodes and an offload daemon under random SIGKILL/SIGSTOP,
every answered token checked against a single-process run (``kvbridge soak``).

Runs by default (a 30-second load phase, about 90 seconds in all on a 2-core machine);
``KVBRIDGE_SOAK_S=20`` shortens the load phase for a quick run, ``-m "not soak"`` leaves
it out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvbridge.proto import ConfigError
from kvbridge.worker.cli import main
from kvbridge.worker.tools.chaos import chaos_schedule
from kvbridge.worker.tools.soak_config import SoakConfig

SOAK_S = float(os.environ.get("KVBRIDGE_SOAK_S", "30"))


def test_chaos_schedule_is_drawn_from_the_seed_and_always_kills_and_stops() -> None:
    config = SoakConfig(duration_s=20)
    targets = ["decode0", "decode1", "offload", "prefill0", "prefill1"]
    first = chaos_schedule(7, targets, config)
    assert first == chaos_schedule(7, targets, config)
    assert first != chaos_schedule(8, targets, config)
    assert {e.action for e in first[:2]} == {"kill", "stop"}
    stops = [e.stop_s for s in range(20) for e in chaos_schedule(s, targets, config) if e.stop_s]
    assert max(stops) > config.lease_ttl_s, "some stops must outlive a lease"


def test_soak_config_names_the_bad_knob() -> None:
    with pytest.raises(ConfigError, match=r"load_timeout_s .* must be shorter than lease_ttl_s"):
        SoakConfig(lease_ttl_s=2, load_timeout_s=2)
    with pytest.raises(ConfigError, match="decode_nodes must be >= 1"):
        SoakConfig(decode_nodes=0)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 300)
def test_soak_serves_every_request_exactly_through_kills_and_stops(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = main(["soak", "--duration", str(SOAK_S), "--seed", "0", "--out", str(out)])
    summary = json.loads(out.read_text())
    keys = ("requests", "answered", "retried", "recomputed", "kills", "stops")
    print("soak summary:", {k: summary[k] for k in keys})
    assert summary["wrong"] == 0, summary["wrong_requests"]
    assert summary["hangs"] == 0, summary["errors"]
    assert summary["failed"] == 0, summary["errors"]
    assert summary["leaks"] == [], summary["chaos"]
    assert summary["answered"] > 0 and summary["kills"] >= 1 and summary["stops"] >= 1
    assert code == 0

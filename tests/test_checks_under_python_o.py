"""Checks on ids that leave or enter the process hold under ``python -O`` (asserts stripped).

Block ids the owner pins go on the wire and a peer READs them. Each check raises a typed
``KVBridgeError``. ``CHECKS`` runs once in this process and once in a ``python -O``
subprocess, and both must report the same errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECKS = textwrap.dedent(
    '''
    import json
    from collections.abc import Mapping, Sequence

    from kvbridge.connector.control.leases import BlockOwner, LeaseTable
    from kvbridge.connector.control.server import ControlHandlers, ControlServerConfig
    from kvbridge.connector.control.types import PeerInfo, Role
    from kvbridge.proto import control_pb2 as pb
    from kvbridge.proto.presets import preset_layout


    class LyingOwner(BlockOwner):
        """Pins whatever ids it was told to answer with; records every unpin."""

        def __init__(self, answer: dict[str, list[object]]) -> None:
            self.answer = answer
            self.unpinned: list[dict[str, list[object]]] = []

        def num_blocks(self, group: str) -> int:
            return 8

        def pin_hashes(self, group_hashes: Mapping[str, Sequence[bytes]]) -> dict:
            return {g: list(ids) for g, ids in self.answer.items()}

        def unpin(self, blocks: Mapping[str, Sequence[int]]) -> None:
            self.unpinned.append({g: list(ids) for g, ids in blocks.items()})


    def outcome(call) -> str:
        try:
            call()
        except Exception as exc:
            return type(exc).__name__
        return "accepted"


    layout = preset_layout("tiny", num_blocks=8)
    local = PeerInfo("prefill-0", Role.PREFILL, layout, agent_metadata=b"agent")
    ask = pb.PinRequest(
        hashes=pb.PinByHashes(groups=[pb.GroupHashes(group="self", hashes=[b"h" * 32] * 2)])
    )
    report = {}
    for case, answer in {
        "id past the pool": {"self": [0, 8]},
        "negative id": {"self": [-1]},
        "more ids than hashes": {"self": [0, 1, 2]},
        "group not asked for": {"self": [0], "cross": [0]},
        "good answer": {"self": [0, 1]},
    }.items():
        owner = LyingOwner(answer)
        handlers = ControlHandlers(local, LeaseTable(owner), ControlServerConfig())
        report["pin: " + case] = outcome(lambda: handlers.pin(ask))
        report["unpinned: " + case] = bool(owner.unpinned)
    print(json.dumps(report))
    '''
)

EXPECTED = {
    "pin: id past the pool": "BlockPoolError",
    "pin: negative id": "BlockPoolError",
    "pin: more ids than hashes": "BlockPoolError",
    "pin: group not asked for": "BlockPoolError",
    "pin: good answer": "accepted",
    "unpinned: id past the pool": True,
    "unpinned: negative id": True,
    "unpinned: more ids than hashes": True,
    "unpinned: group not asked for": True,
    "unpinned: good answer": False,
}


def run_checks(*python_flags: str) -> dict[str, object]:
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, *python_flags, "-c", CHECKS],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("flags", [(), ("-O",)], ids=["asserts-on", "python-O"])
def test_untrusted_ids_raise_typed_errors_with_and_without_asserts(
    flags: tuple[str, ...],
) -> None:
    assert run_checks(*flags) == EXPECTED

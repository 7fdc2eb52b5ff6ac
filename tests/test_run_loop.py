"""The run loop every server command shares: ready line, ready file, clean stop on a signal."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvbridge.worker.run_loop import Ready, serve_until_stopped


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_command_cleanly_and_restores_the_handlers(
    signum: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    closed: list[str] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def start(stack: ExitStack) -> Ready:
        stack.callback(closed.append, "first")
        stack.callback(closed.append, "second")
        threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()
        return Ready('{"address": "here"}', "test server")

    ready = tmp_path / "ready.json"
    assert serve_until_stopped(start, ready_file=ready) == 0
    assert capsys.readouterr().out == '{"address": "here"}\n'
    assert ready.read_text() == '{"address": "here"}'
    assert closed == ["second", "first"]  # the reverse of start
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_failed_start_closes_what_it_started_and_restores_the_handlers() -> None:
    closed: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    def start(stack: ExitStack) -> Ready:
        stack.callback(closed.append, "transport")
        raise RuntimeError("port taken")

    with pytest.raises(RuntimeError, match="port taken"):
        serve_until_stopped(start)
    assert closed == ["transport"]
    assert signal.getsignal(signal.SIGTERM) == before

"""ChildProcess: ready on one stdout line, fails fast and loud otherwise, never leaks."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbridge.proto import KVBridgeError
from kvbridge.worker import ChildProcess, LaunchError, json_object, listening_on
from kvbridge.worker.child import READY_ENV, READY_TIMEOUT_S, ready_timeout


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_ready_info_is_the_json_of_the_ready_line_after_other_output() -> None:
    code = "print('warming up'); print('READY {\"port\": 7}', flush=True); input()"
    with ChildProcess(python(code), name="ok", stdin=True) as child:
        assert child.info == {"port": 7}
        assert child.wait_ready() == {"port": 7}
    assert child.poll() is not None


def test_a_child_that_exits_before_ready_raises_with_its_stderr() -> None:
    code = "import sys; sys.stderr.write('no config here\\n'); sys.exit(3)"
    child = ChildProcess(python(code), name="broken")
    with pytest.raises(LaunchError, match=r"(?s)broken exited with 3.*no config here") as info:
        child.wait_ready(30)
    assert isinstance(info.value, KVBridgeError) and isinstance(info.value, RuntimeError)
    assert child.poll() == 3


def test_a_silent_child_is_killed_at_the_deadline() -> None:
    child = ChildProcess(python("import time; time.sleep(60)"), name="silent")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="silent was not ready after 1s"):
        child.wait_ready(1.0)
    assert time.monotonic() - t0 < 10
    assert child.poll() == -signal.SIGKILL


def test_a_malformed_ready_line_is_an_error_not_a_hang() -> None:
    child = ChildProcess(python("print('READY [1]', flush=True); input()"), name="odd", stdin=True)
    with pytest.raises(LaunchError, match="bad ready line"):
        child.wait_ready(30)


def test_banners_of_kvbridge_commands_are_readiness_lines() -> None:
    banner = "kvbridge offload: daemon x listening on 127.0.0.1:5000, capacity 1 bytes"
    assert listening_on(banner) == {"address": "127.0.0.1:5000", "banner": banner}
    assert listening_on("p listening on 127.0.0.1:6000 with token auth")["address"] == (  # type: ignore[index]
        "127.0.0.1:6000"
    )
    assert listening_on("starting") is None
    assert json_object('{"inference": "a:1"}') == {"inference": "a:1"}
    assert json_object("{not json") is None


def test_sigstop_returns_once_stopped_and_close_still_ends_the_child() -> None:
    with ChildProcess(python("print('READY {}', flush=True); input()"), name="s", stdin=True) as c:
        c.send_signal(signal.SIGSTOP)
        state = Path(f"/proc/{c.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T"
    assert c.poll() is not None  # close resumed it and ended it


def test_stdout_after_ready_is_the_owners_with_keep_stdout() -> None:
    code = "print('READY {}'); print('one'); print('two', flush=True); input()"
    with ChildProcess(python(code), name="lines", stdin=True, keep_stdout=True) as child:
        assert child.stdout.readline() == b"one\n"
        assert child.stdout.readline() == b"two\n"


def test_close_leaves_no_thread_and_no_open_pipe() -> None:
    before = threading.active_count()
    child = ChildProcess(python("print('READY {}', flush=True); input()"), name="c", stdin=True)
    child.wait_ready(30)
    child.close()
    child.close()  # idempotent
    assert threading.active_count() == before
    assert child.proc.stdout is not None and child.proc.stdout.closed
    assert child.proc.stdin is not None and child.proc.stdin.closed


def test_stderr_goes_to_the_log_file(tmp_path: Path) -> None:
    code = "import sys; sys.stderr.write('hello log\\n'); print('READY {}', flush=True); input()"
    with ChildProcess(python(code), name="l", stdin=True, log=tmp_path / "c.log") as child:
        pass
    assert "hello log" in (tmp_path / "c.log").read_text()
    assert "hello log" in child.log()


def test_a_child_that_exits_while_a_grandchild_holds_its_stdout_fails_at_once(
    tmp_path: Path,
) -> None:
    # the grandchild inherits stdout, so the pipe never ends: only the exit says "not ready"
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(g.pid)); sys.exit(4)"
    )
    child = ChildProcess(python(code), name="parent")
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchError, match="parent exited with 4"):
            child.wait_ready(60)
        assert time.monotonic() - t0 < 15  # not the 60 s deadline
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        child.close()


def test_the_ready_wait_comes_from_the_environment_or_scales_with_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(READY_ENV, "1.5")
    assert ready_timeout() == (1.5, f"from {READY_ENV}")
    child = ChildProcess(python("import time; time.sleep(60)"), name="slow")
    with pytest.raises(LaunchError, match=rf"slow was not ready after 1.5s \(from {READY_ENV}\)"):
        child.wait_ready()
    for bad in ("soon", "0", "-3", "inf"):
        monkeypatch.setenv(READY_ENV, bad)
        with pytest.raises(LaunchError, match=rf"^{READY_ENV}=.* must be a positive number"):
            ready_timeout()
    monkeypatch.delenv(READY_ENV)
    wait, why = ready_timeout()
    assert READY_TIMEOUT_S <= wait <= READY_TIMEOUT_S * 5, (wait, why)
    assert "load average" in why and READY_ENV in why

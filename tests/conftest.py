"""Shared test settings: UCX must not load its InfiniBand modules (processes
segfault at exit otherwise).

Fixtures here are opt-in (``pytestmark = pytest.mark.usefixtures("one_thread")``); helpers
that are not fixtures live in ``tests/harness``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.peer import PeerProc, attacker_idle, attacker_peer
from tests.harness.vllm import SharedPair, shared_pair

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test: tiny matmuls are ~100x slower with a
    second thread on a busy 2-core box."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1 and its key: ``(cert, key)``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedPair]:
    """The session's kvbridge P/D pair and plain engine in real vLLM (tests/harness/vllm.py)."""
    yield from shared_pair(tmp_path_factory.mktemp("vllm-pair"))


@pytest.fixture(scope="module")
def attacker_process() -> Iterator[PeerProc]:
    """One token holder's NIXL agent per module (tests/harness/peer.py: ``attacker_peer``)."""
    with attacker_peer() as peer:
        yield peer


@pytest.fixture
def attacker(attacker_process: PeerProc) -> Iterator[PeerProc]:
    """The module's attacker process; after the test nothing of it is left registered,
    linked or in flight (each ``forge`` cleans up after itself)."""
    attacker_idle(attacker_process)
    yield attacker_process
    attacker_idle(attacker_process)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``destructive`` (they kill a process the module's other tests share) run
    after the other tests of their module; everything else keeps its order, shuffled or not
    (pytest-randomly shuffles before this hook runs)."""
    out: list[pytest.Item] = []
    i = 0
    while i < len(items):
        j = i
        while j < len(items) and items[j].module is items[i].module:  # type: ignore[attr-defined]
            j += 1
        group = items[i:j]
        out += [t for t in group if t.get_closest_marker("destructive") is None]
        out += [t for t in group if t.get_closest_marker("destructive") is not None]
        i = j
    items[:] = out

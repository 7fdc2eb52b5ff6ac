"""Shared test settings: UCX must not load its InfiniBand modules (DESIGN.md §5).

Fixtures here are opt-in (``pytestmark = pytest.mark.usefixtures("one_thread")``); helpers
that are not fixtures live in ``tests/harness``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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

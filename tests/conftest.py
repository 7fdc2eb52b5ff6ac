"""Shared test settings: UCX must not load its InfiniBand modules (DESIGN.md §5)."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("PYTHONHASHSEED", "0")

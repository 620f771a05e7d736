"""Shared pytest fixtures. Real data lives in ../shared/data beside the repo; tests that need it skip
with a clear message when it is absent."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA

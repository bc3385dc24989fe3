"""Shared fixtures. Integration tests (worker processes) live in tests/integration/."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture
def repo() -> Path:
    return REPO

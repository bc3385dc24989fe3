"""Shared fixtures. Integration tests (worker processes) live in tests/integration/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests run tiny models on a shared 2-core box, where intra-op threads only contend (10-50x
    slower under load); worker processes set their own thread counts."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

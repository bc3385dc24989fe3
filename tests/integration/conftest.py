"""Every test under tests/integration spawns worker processes (multi-process gloo worlds, agents, CLI runs),
so each is marked `integration` here, in one place (`pytest -m integration` / `-m 'not integration'`).
Under xdist they also run one after another on one worker: tests/conftest.py's scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.integration)

"""Every test under tests/integration spawns worker processes (multi-process gloo worlds, agents, CLI runs).

They are marked `integration` here, in one place, and put in one xdist group: under `make test`
(`pytest -n 2 --dist loadgroup`) they run one after another on one xdist worker, as they were written to
(a world of four processes already fills the box's two cores, and the hang and heartbeat tests time real
silences), while the single-process unit tests share the other core.
"""

from __future__ import annotations

from pathlib import Path

import pytest

WORLDS = pytest.mark.xdist_group("worlds")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.integration)
            item.add_marker(WORLDS)

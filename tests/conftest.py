"""Shared fixtures. Integration tests (worker processes) live in tests/integration/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


# Integration modules that may run beside the serial group (see pytest_xdist_make_scheduler): the dry run of
# scripts/gpu_check.sh (2 processes, ~140 s on a loaded box) and the document runs through the CLI (~100 s).
BESIDE = frozenset({
    "tests/integration/scripts/test_gpu_check.py",
    "tests/integration/launch/test_train_documents.py",
})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test` runs two xdist workers. The integration tests go to one of them as one unit, in their
    order: a world of four processes already fills the box's two cores, and the hang and heartbeat tests time
    real silences, so two worlds at once would only make them slow and flaky. The single-process unit tests
    are dealt one by one to whichever worker is free. (xdist's own `loadgroup` would do this from a mark, but
    its renaming of node ids does not take on pytest 9.)

    Run serially, the integration tests would be the whole run's wall time (the other worker idle once the
    unit tests are done), so the modules in ``BESIDE`` go to the other worker, each as one unit (their
    module fixtures start once): they run scripts end to end, time no silence and assert no duration. xdist
    deals the units with the most tests first, so the serial group and these start at once and the single
    unit tests fill in behind them."""
    from xdist.scheduler import LoadScopeScheduling

    worlds = "tests/integration/"

    class WorldsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module in BESIDE:
                return module
            return worlds if nodeid.startswith(worlds) else nodeid

    return WorldsTogether(config, log)


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

"""Plan dictionaries written to a file and loaded, or refused, the way `hspmd validate` reads them (shared by
the spec tests of chunks, op costs and activation limits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_plan_context


def load(tmp_path: Path, data: dict):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_plan_context(path)


def problems(tmp_path: Path, data: dict) -> list[str]:
    """The refusal's lines without the file prefix every one of them must carry."""
    with pytest.raises(SpecError) as err:
        load(tmp_path, data)
    lines = err.value.lines()
    prefix = str(tmp_path / "plan.yaml") + ": "
    assert all(line.startswith(prefix) for line in lines), lines
    return [line[len(prefix):] for line in lines]

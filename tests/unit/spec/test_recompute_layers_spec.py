"""Partial recompute in the plan (``Stage.recompute_layers``): parsing, write-back, which layers of a stage
recompute, and one-line refusals naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from plan_files import load, problems

from runtime.torchfree.spec.io import dump_yaml
from runtime.torchfree.spec.schema import to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = yaml.safe_load((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text())
S1 = "strategies[0].pipelines[1].stages[1]"


def partial(**stage: object) -> dict:
    """cpu-hetero4-tiny with ``stage``'s keys set on pipeline 1's second stage (layers [3, 6))."""
    data = copy.deepcopy(BASE)
    data["strategies"][0]["pipelines"][1]["stages"][1].update(stage)
    return data


def test_recompute_layers_parse_write_back_and_count(tmp_path: Path) -> None:
    ctx = load(tmp_path, partial(recompute_layers=2))
    st = ctx.plan.strategies[0].pipelines[1].stages[1]
    assert st.recompute_layers == 2 and not st.recompute
    assert st.recomputed_layers == 2 and st.chunk_recompute(0) == 2 and st.recompute_text() == "2 of 3"
    data = to_data(ctx.plan)
    assert data["strategies"][0]["pipelines"][1]["stages"][1]["recompute_layers"] == 2
    assert "recompute_layers" not in data["strategies"][0]["pipelines"][1]["stages"][0]   # None: not written
    assert load(tmp_path, yaml.safe_load(dump_yaml(data))).plan == ctx.plan
    every = load(tmp_path, partial(recompute=True)).plan.strategies[0].pipelines[1].stages[1]
    assert every.recomputed_layers == 3 and every.recompute_text() == "yes"   # recompute: true is every layer


BAD = {
    "negative": ({"recompute_layers": -1}, [f"{S1}.recompute_layers: must be an integer >= 0, got -1"]),
    "bool": ({"recompute_layers": True}, [f"{S1}.recompute_layers: expected an integer, got True (bool)"]),
    "both": ({"recompute": True, "recompute_layers": 1},
             [f"{S1}.recompute_layers: set together with recompute: true (which recomputes every layer); give one"]),
    "too many": ({"recompute_layers": 4}, [f"{S1}.recompute_layers: recomputes 4 layers but the stage holds 3"]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_recompute_layers_one_line_with_the_path(tmp_path: Path, case: str) -> None:
    stage, want = BAD[case]
    assert problems(tmp_path, partial(**stage)) == want

"""The plan format's mixed-length fields: ``training.tokens_per_step`` and ``Strategy.max_seq_len`` parse,
write back and are validated (length ranges that leave a length uncovered are refused, naming the field)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from runtime.torchfree.errors import SpecError
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.schema import to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = yaml.safe_load((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text())


def two_strategies(short: int | None, long: int | None, tokens: int | None = 512) -> dict:
    data = copy.deepcopy(BASE)
    data["training"]["tokens_per_step"] = tokens
    first = copy.deepcopy(data["strategies"][0])
    second = copy.deepcopy(first)
    first["name"], second["name"] = "short", "long"
    first["max_seq_len"], second["max_seq_len"] = short, long
    data["strategies"] = [first, second]
    return data


def write(tmp_path: Path, data: dict) -> Path:
    data = copy.deepcopy(data)
    for s in data["strategies"]:
        if s.get("max_seq_len") is None:
            s.pop("max_seq_len", None)
    if data["training"].get("tokens_per_step") is None:
        data["training"].pop("tokens_per_step", None)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def lines_of(tmp_path: Path, data: dict) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_plan_context(write(tmp_path, data))
    return err.value.lines()


def test_fields_parse_and_write_back(tmp_path):
    seq = BASE["training"]["seq_len"]
    ctx = load_plan_context(write(tmp_path, two_strategies(seq // 4, None)))
    t = ctx.plan.training
    assert t.tokens_per_step == 512
    assert [s.max_seq_len for s in ctx.plan.strategies] == [seq // 4, None]
    assert [s.max_len_of(t) for s in ctx.plan.strategies] == [seq // 4, seq]
    data = to_data(ctx.plan)
    assert data["training"]["tokens_per_step"] == 512
    assert data["strategies"][0]["max_seq_len"] == seq // 4
    assert "max_seq_len" not in data["strategies"][1]      # None is omitted: the default form stays as it was
    again = tmp_path / "again"
    again.mkdir()
    path = again / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_plan_context(path).plan == ctx.plan


def test_untagged_plans_unchanged(tmp_path):
    ctx = load_plan_context(write(tmp_path, copy.deepcopy(BASE)))
    assert ctx.plan.training.tokens_per_step is None
    assert all(s.max_seq_len is None for s in ctx.plan.strategies)
    assert "tokens_per_step" not in to_data(ctx.plan)["training"]


def test_uncovered_range_refused(tmp_path):
    seq = BASE["training"]["seq_len"]
    lines = lines_of(tmp_path, two_strategies(seq // 4, seq // 2))
    assert len(lines) == 1
    assert "plan.yaml: strategies[1].max_seq_len:" in lines[0]
    assert f"leaving ({seq // 2}, {seq}]" in lines[0] and "uncovered" in lines[0]


def test_descending_ranges_refused(tmp_path):
    seq = BASE["training"]["seq_len"]
    lines = lines_of(tmp_path, two_strategies(seq, seq // 2))
    assert any("strategies[1].max_seq_len: 32 does not exceed the previous strategy's 64" in x for x in lines)


def test_range_past_seq_len_refused(tmp_path):
    seq = BASE["training"]["seq_len"]
    lines = lines_of(tmp_path, two_strategies(seq // 2, seq * 2))
    assert any(f"strategies[1].max_seq_len: {seq * 2} exceeds training.seq_len {seq}" in x for x in lines)


@pytest.mark.parametrize("field,where", [("tokens_per_step", "training.tokens_per_step"),
                                         ("max_seq_len", "strategies[0].max_seq_len")])
def test_non_positive_refused(tmp_path, field, where):
    data = two_strategies(16, None)
    if field == "tokens_per_step":
        data["training"]["tokens_per_step"] = 0
    else:
        data["strategies"][0]["max_seq_len"] = 0
    lines = lines_of(tmp_path, data)
    assert any(f"{where}: must be at least 1, got 0" in x for x in lines)

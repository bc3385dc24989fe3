"""Stages holding several layer ranges (model chunks) and per-pipeline schedules: parsing, write-back,
validation messages (one line each, with the field path) and the handle's schedule."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from plan_files import load, problems

from runtime.torchfree.errors import FieldErrors
from runtime.torchfree.pipeline_schedules import check_schedule
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.io import dump_yaml
from runtime.torchfree.spec.plan import Pipeline, Stage
from runtime.torchfree.spec.schema import to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = yaml.safe_load((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text())


def interleaved_plan() -> dict:
    """Pipeline 1 (devices 2, 3) interleaved with uneven chunks; pipeline 0 stays on the 1F1B default."""
    data = copy.deepcopy(BASE)
    pipe = data["strategies"][0]["pipelines"][1]
    pipe["schedule"] = "interleaved"
    pipe["stages"][0]["layers"] = [[0, 2], [3, 5]]
    pipe["stages"][1]["layers"] = [[2, 3], [5, 6]]
    return data




def test_stage_accepts_a_pair_or_ranges() -> None:
    one = Stage((0,), (2, 6))
    assert one.layers == ((2, 6),) and one.chunks == 1 and one.num_layers == 4
    assert one.layer_ids == (2, 3, 4, 5) and one.layers_data() == [2, 6]
    two = Stage((1, 2), ((4, 6), (0, 1)))
    assert two.chunks == 2 and two.num_layers == 3 and two.tp == 2
    assert two.layer_ids == (0, 4, 5) and two.holds_layer(4) and not two.holds_layer(2)
    assert two.layers_data() == [[4, 6], [0, 1]] and two.layers_text() == "[4, 6) + [0, 1)"
    assert Stage((0,), [[0, 3]]) == Stage((0,), (0, 3))
    with pytest.raises(FieldErrors) as err:
        Stage((0,), ((0, 2), (3, 3)))
    assert list(err.value.problems) == [("layers[1]", "must be a non-empty range [start, end) with 0 <= start < end, "
                                                "got [3, 3]")]


def test_chunks_parse_write_back_and_schedule(tmp_path: Path) -> None:
    ctx = load(tmp_path, interleaved_plan())
    strategy = ctx.plan.strategies[0]
    assert strategy.pipelines[1].stages[0].layers == ((0, 2), (3, 5))
    assert strategy.pipelines[0].stages[0].layers == ((0, 6),)
    data = to_data(ctx.plan)
    pipes = data["strategies"][0]["pipelines"]
    assert pipes[0]["stages"][0]["layers"] == [0, 6]  # one chunk: written as a bare pair
    assert "schedule" not in pipes[0]  # None: the training default, not written
    assert pipes[1]["schedule"] == "interleaved"
    assert pipes[1]["stages"][1]["layers"] == [[2, 3], [5, 6]]
    again = load(tmp_path, yaml.safe_load(dump_yaml(data)))
    assert again.plan == ctx.plan

    h = StrategyHandle.of(ctx)
    assert strategy.schedule_of(0, ctx.plan.training) == "1f1b" == h.schedule_name(0)
    assert h.schedule_name(1) == "interleaved"
    sched = h.pipeline_schedule(1)
    assert sched is h.pipeline_schedule(1)  # cached
    assert sched.layout.chunks == 2 and len(sched.actions) == 2
    assert check_schedule(sched.actions, sched.layout, 2, split_backward=sched.split_backward).ok
    # A pure function of the plan: another handle on an equal plan builds equal lists.
    assert StrategyHandle.of(load(tmp_path, interleaved_plan())).pipeline_schedule(1).actions == sched.actions
    assert h.describe() == "[0,1]:0-6 x6 | [2]:0-2+3-5 > [3]:2-3+5-6 x2 interleaved"


def test_costs_follow_chunk_layer_counts(tmp_path: Path) -> None:
    """Uneven chunks: the heavier chunk's ops take longer in the schedule the plan implies."""
    sched = StrategyHandle.of(load(tmp_path, interleaved_plan())).pipeline_schedule(1)
    dur = {(t.op.stage, t.op.kind): t.end - t.start for row in sched.timeline for t in row}
    assert dur[0, "F"] == 2 and dur[1, "F"] == 1 and dur[2, "F"] == 2 and dur[3, "F"] == 1
    assert dur[0, "BW"] == 4


def edit(fn) -> dict:
    data = interleaved_plan()
    fn(data["strategies"][0]["pipelines"])
    return data


CASES = {
    "overlap": (lambda p: p[1]["stages"][1].update(layers=[[1, 3], [5, 6]]),
                ["strategies[0].pipelines[1].stages[1].layers[0]: overlaps layers [1, 2) of virtual stage 0 "
                 "(stages[0].layers[0], loop placement)"]),
    "tail_uncovered": (lambda p: (p[1]["stages"][0].update(layers=[[0, 2], [3, 4]]),
                                  p[1]["stages"][1].update(layers=[[2, 3], [4, 5]])),
                       ["strategies[0].pipelines[1].stages[1].layers[1]: pipeline ends at layer 5, leaving "
                        "layers [5, 6) of llama-tiny uncovered"]),
    "chunk_counts_differ": (lambda p: p[1]["stages"][1].update(layers=[2, 6]),
                            ["strategies[0].pipelines[1].stages: every stage needs the same number of chunks, "
                             "got [2, 1]"]),
    "interleaved_needs_m_ge_s": (lambda p: (p[0].update(micro_batches=7), p[1].update(micro_batches=1)),
                                 ["strategies[0].pipelines[1].micro_batches: interleaved needs at least one "
                                  "micro-batch per stage (2), got 1"]),
    "1f1b_with_chunks": (lambda p: p[1].update(schedule="1f1b"),
                         ["strategies[0].pipelines[1].stages: 1f1b holds 1 chunk(s) per device, got 2 "
                          "(the layer ranges each stage lists, under 1f1b)"]),
    "zb_v_needs_two_chunks": (lambda p: p[0].update(schedule="zb-v"),
                              ["strategies[0].pipelines[0].stages: zb-v holds 2 chunk(s) per device, "
                               "got 1 (the layer ranges each stage lists, under zb-v)"]),
    "unknown_schedule": (lambda p: p[1].update(schedule="dualpipe"),
                         ["strategies[0].pipelines[1].schedule: expected one of '1f1b', 'gpipe', 'interleaved', "
                          "'zb-h1', 'zb-v', got 'dualpipe' (str)"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule(tmp_path: Path, name: str) -> None:
    fn, expected = CASES[name]
    got = problems(tmp_path, edit(fn))
    assert got == expected


def test_v_placement_order(tmp_path: Path) -> None:
    """ZB-V's virtual stages run down the devices and back up: device 0 holds the first and last."""
    data = copy.deepcopy(BASE)
    pipe = data["strategies"][0]["pipelines"][1]
    pipe["schedule"] = "zb-v"
    pipe["stages"][0]["layers"] = [[0, 2], [5, 6]]
    pipe["stages"][1]["layers"] = [[2, 3], [3, 5]]
    h = StrategyHandle.of(load(tmp_path, data))
    assert h.schedule_name(1) == "zb-v" and h.pipeline_schedule(1).layout.placement == "v"
    # The loop order of the same ranges is rejected under interleaved.
    pipe["schedule"] = "interleaved"
    assert problems(tmp_path, data) == [
        "strategies[0].pipelines[1].stages[0].layers[1]: leaves layers [3, 5) uncovered "
        "(virtual stage 1 (stages[1].layers[0], loop placement) ends at 3)",
        "strategies[0].pipelines[1].stages[1].layers[1]: overlaps layers [3, 5) of the virtual stages before it"]


def test_pipeline_constructor_default_schedule() -> None:
    p = Pipeline(2, (Stage((0,), (0, 3)), Stage((1,), (3, 6))))
    assert p.schedule is None


def test_validate_cli_one_line_per_problem(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hetu_cli.main import cli

    data = edit(lambda p: (p[1]["stages"][1].update(layers=[[1, 3], [5, 6]]), p[1].update(micro_batches=1),
                           p[0].update(micro_batches=7)))
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(cli, ["validate", str(path)])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines == [
        f"error: {path}: strategies[0].pipelines[1].micro_batches: interleaved needs at least one micro-batch "
        "per stage (2), got 1",
        f"error: {path}: strategies[0].pipelines[1].stages[1].layers[0]: overlaps layers [1, 2) of virtual "
        "stage 0 (stages[0].layers[0], loop placement)"], res.output

"""ZeRO-1's layout rules (runtime/torchfree/engine/zero.py) for every plan, its description, and what refuses it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_specialize import ENGINE_PLANS, MODEL, plans

from hetu_cli.main import cli
from runtime.engine.optim import flat_range, write_flat_range
from runtime.torchfree.annotations.from_plan import strategy_annotations
from runtime.torchfree.annotations.states import region_index
from runtime.torchfree.comm.gradsync import BUCKET_BYTES
from runtime.torchfree.engine.describe import describe_program
from runtime.torchfree.engine.zero import moment_pieces, zero_buckets, zero_slices
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import PlanContext, load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.handle import StrategyHandle

REPO = Path(__file__).resolve().parents[3]


def with_zero(ctx: PlanContext, zero: bool = True) -> PlanContext:
    training = dataclasses.replace(ctx.plan.training, zero=zero)
    return dataclasses.replace(ctx, plan=dataclasses.replace(ctx.plan, training=training))


@settings(max_examples=30, deadline=None)
@given(plans())
def test_every_moment_element_is_kept_once_by_a_device_that_holds_it(ctx: PlanContext) -> None:
    strategy = ctx.plan.strategies[0]
    ann = strategy_annotations(StrategyHandle(ctx, strategy))
    slices = zero_slices(ann)
    if len(strategy.pipelines) == 1:
        assert slices == {}  # no data-parallel replicas: nothing to shard
        return
    assert set(slices) == {p.name for p in llama_parameters(MODEL)}
    counts = {p.name: torch.zeros(p.shape, dtype=torch.int32).reshape(-1) for p in llama_parameters(MODEL)}
    index = {p.name: torch.arange(p.numel).reshape(p.shape) for p in llama_parameters(MODEL)}
    for d in strategy.devices:
        for name, pieces in moment_pieces(slices, d).items():
            held = ann.param(name).param.layout(ann.param(name).shape).region(d)
            for p in pieces:
                assert all(a <= x and y <= b for (a, b), (x, y) in zip(held, p.region)), "a piece the device lacks"
                counts[name][index[name][region_index(p.region)].reshape(-1)[p.start:p.stop]] += 1
    for name, c in counts.items():
        assert bool((c == 1).all()), f"{name}: moments must be kept exactly once"
    for sl in slices.values():
        for s in sl:
            sizes = [b - a for a, b in (s.chunk(d) for d in s.devices)]
            assert len(s.devices) >= 2 and max(sizes) - min(sizes) <= 1 and sum(sizes) == s.numel
    # The all-gathers carry every slice exactly once, one bucket per group at most 32 MiB (or one slice).
    carried = [(s.name, s.region) for b in zero_buckets(ann, slices, bucket_bytes=BUCKET_BYTES) for s in b.slices]
    assert sorted(carried) == sorted((s.name, s.region) for sl in slices.values() for s in sl)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.data())
def test_flat_range_of_a_column_slice_is_the_flattened_slice(rows: int, cols: int, data) -> None:
    full = torch.arange(rows * cols * 2, dtype=torch.float32).reshape(rows, cols * 2)
    c0 = data.draw(st.integers(0, cols))
    view = full[:, c0:c0 + cols]
    start = data.draw(st.integers(0, view.numel()))
    stop = data.draw(st.integers(start, view.numel()))
    assert torch.equal(flat_range(view, start, stop), view.reshape(-1)[start:stop])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.data())
def test_write_flat_range_sets_exactly_those_elements_of_a_column_slice(rows: int, cols: int, data) -> None:
    full = torch.arange(rows * cols * 2, dtype=torch.float32).reshape(rows, cols * 2)
    c0 = data.draw(st.integers(0, cols))
    view = full[:, c0:c0 + cols]
    start = data.draw(st.integers(0, view.numel()))
    stop = data.draw(st.integers(start, view.numel()))
    want = full.clone()
    flat = want[:, c0:c0 + cols].reshape(-1).clone()
    flat[start:stop] = -1.0 - torch.arange(stop - start, dtype=torch.float32)
    want[:, c0:c0 + cols] = flat.view(rows, cols)
    write_flat_range(view, start, stop, -1.0 - torch.arange(stop - start, dtype=torch.float32))
    assert torch.equal(full, want)


def test_description_lists_the_all_gathers_only_with_zero() -> None:
    ctx = load_plan_context(ENGINE_PLANS / "three-pipelines.yaml")
    plain = describe_program(StrategyHandle.of(ctx, "hetero3"), 1)
    zero = describe_program(StrategyHandle.of(with_zero(ctx), "hetero3"), 1)
    assert not any(o.name.startswith("param all-gather") for o in plain.ops)
    gathers = [o for o in zero.ops if o.name.startswith("param all-gather")]
    assert gathers and zero.ops[-len(gathers) - 1].name == "optimizer"
    assert [o for o in zero.ops if not o.name.startswith("param all-gather")][:-1] == list(plain.ops[:-1])
    # device 1 (TP-2 with device 0) shares its norm weights with 0, 3 and 4: a group of four.
    assert any(o.name == "param all-gather [0,1,3,4]" for o in gathers)
    assert "ZeRO-1: " in zero.ops[-len(gathers) - 1].detail
    one_pipeline = describe_program(StrategyHandle.of(with_zero(load_plan_context(ENGINE_PLANS / "pp-uneven.yaml")),
                                                      "pp"), 0)
    assert "nothing sharded" in one_pipeline.ops[-1].detail


def test_elastic_and_switch_refuse_zero_plans_before_starting(tmp_path) -> None:
    tiny = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
    plan = load_plan(tiny)
    zero = tmp_path / "zero.yaml"
    save_plan(dataclasses.replace(plan, model="llama-tiny", cluster="cpu-hetero4",
                                  training=dataclasses.replace(plan.training, zero=True)), zero)
    for args in (["--plan", str(zero), "--elastic"], ["--plan", str(zero), "--switch", f"2:{tiny}"],
                 ["--plan", str(tiny), "--switch", f"2:{zero}"]):
        res = CliRunner().invoke(cli, ["train", "--steps", "3", *args])
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "zero" in lines[0], res.output
        assert "started" not in res.output

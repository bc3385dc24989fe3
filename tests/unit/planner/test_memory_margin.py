"""``--memory-margin``: every planned stage keeps the margin free, on every shipped cluster; the report
shows each stage's headroom against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetu_cli.main import cli
from planner.cost import GIB, CostModel, zero_copies
from planner.margin import DEFAULT_MEMORY_MARGIN, MemoryMargin, parse_margin
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.catalog import catalog_names, load_cluster


def peaks_against_capacity(plan_file: Path) -> list[tuple[float, float]]:
    """(peak GiB, capacity GiB) per planned device, priced afresh on the real cluster."""
    ctx = load_plan_context(plan_file)
    t = ctx.plan.training
    profiles = resolve_profiles(ctx.cluster.device_types)
    est = CostModel.for_plan(ctx.plan, ctx.model, ctx.cluster, profiles).estimate(
        ctx.plan.strategies[0], t.global_batch, t.schedule, zero_copies(t))
    return [(m.total / GIB, ctx.cluster.type_of(d).memory_gib) for d, m in est.memory.items()]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cluster=st.sampled_from(catalog_names("clusters")),
       model=st.sampled_from(["llama-tiny", "llama-3.2-1b", "llama-7b", "llama-3-8b"]),
       global_batch=st.sampled_from([8, 16, 32, 64]), seq_len=st.sampled_from([256, 1024, 4096]))
def test_a_margin_of_a_tenth_never_plans_a_stage_above_90_percent(tmp_path_factory, cluster, model, global_batch,
                                                                   seq_len):
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    res = CliRunner().invoke(cli, ["plan", "--model", model, "--cluster", cluster, "--global-batch", str(global_batch),
                                   "--seq-len", str(seq_len), "--time-limit", "2", "--check-top", "1", "--top-k", "1",
                                   "--memory-margin", "0.1", "-o", str(out), "--format", "json"])
    if res.exit_code == 2:   # infeasible requests (a model too big, a sequence too long): nothing planned
        assert not out.exists()
        return
    assert res.exit_code == 0, res.output
    for peak, cap in peaks_against_capacity(out):
        assert peak <= 0.9 * cap + 1e-6, (peak, cap)
    rows = json.loads(res.output)["memory"]
    assert all(r["within_margin"] and r["headroom_frac"] >= 0.1 - 1e-4 for r in rows), rows


def test_a_margin_in_gib_keeps_that_much_free_on_every_device(tmp_path: Path):
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(cli, ["plan", "--model", "llama-3-8b", "--cluster", "h800-h20-48", "--global-batch", "64",
                                   "--seq-len", "4096", "--time-limit", "5", "--check-top", "1",
                                   "--memory-margin", "12GiB", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert all(peak <= cap - 12 + 1e-6 for peak, cap in peaks_against_capacity(out))
    assert "margin GiB" in res.output and "margin 12 GiB per device" in res.output


def test_the_default_margin_is_not_zero_and_is_reported():
    assert DEFAULT_MEMORY_MARGIN.fraction > 0
    res = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8",
                                   "--seq-len", "64", "--time-limit", "2", "--check-top", "0", "--format", "json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["memory_margin"]["fraction"] == DEFAULT_MEMORY_MARGIN.fraction
    assert {"capacity_gib", "margin_gib", "headroom_gib", "headroom_frac", "within_margin"} <= set(out["memory"][0])


def test_replan_takes_a_margin_and_reports_the_new_plans_headroom():
    plan = Path(__file__).resolve().parents[3] / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml"
    ctx = load_plan_context(plan)
    failed = ctx.plan.strategies[0].pipelines[0].stages[0].devices[0]
    res = CliRunner().invoke(cli, ["replan", str(plan), "--failed", str(failed), "--memory-margin", "0.2",
                                   "--format", "json", "--time-limit", "5"])
    if res.exit_code == 2:
        pytest.skip(f"this plan does not survive device {failed}: {res.output}")
    out = json.loads(res.output)
    assert out["memory_margin"]["fraction"] == 0.2
    assert out["memory"] and all(r["peak_gib"] <= 0.8 * r["capacity_gib"] + 1e-6 for r in out["memory"])


def test_a_margin_that_leaves_nothing_is_refused_naming_the_type():
    res = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8",
                                   "--seq-len", "64", "--memory-margin", "10000GiB"])
    assert res.exit_code == 2 and res.output.startswith("error: --memory-margin: 10000 GiB per device leaves nothing")


@pytest.mark.parametrize("text, margin", [("0.1", MemoryMargin(fraction=0.1)), ("0", MemoryMargin()),
                                          ("4GiB", MemoryMargin(gib=4.0)), ("2.5 gib", MemoryMargin(gib=2.5))])
def test_margins_parse(text, margin):
    assert parse_margin(text) == margin


@pytest.mark.parametrize("text", ["1", "1.5", "-0.1", "4GB", "x", "", "nan", "4 GiB GiB"])
def test_bad_margins_are_refused(text):
    with pytest.raises(ValueError):
        parse_margin(text)


def test_apply_reduces_every_type_and_keeps_the_rest():
    cluster = load_cluster("h800-h20-48")
    reduced = MemoryMargin(fraction=0.25).apply(cluster)
    for name, dt in cluster.device_types.items():
        assert reduced.device_types[name].memory_gib == pytest.approx(0.75 * dt.memory_gib)
    assert reduced.num_devices == cluster.num_devices and reduced.name == cluster.name

"""Profile tables (compute by micro-batch size, sequence length and TP degree; links by message size and
direction), per-layer overrides and ``includes_tp_comm``: the cost model prices every table point as
measured, and the stated interpolation / extrapolation rules between and beyond them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost import CostModel
from runtime.torchfree.errors import SpecError
from runtime.torchfree.profiling.profile import (
    COMPONENTS,
    MeasuredModel,
    analytic_components,
    eval_fit,
    load_profile,
    save_profile,
    spec_profile,
)
from runtime.torchfree.profiling.tables import ComponentTable, LinkCurve, LinkCurves
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.cluster import Cluster, DeviceType, Node
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

TINY = load_model("llama-tiny")
MBS, LENS = (1, 2, 4), (128, 256)


def table(scale: float, optimizer_s: float | None = None) -> ComponentTable:
    """A grid that is neither affine in B nor quadratic in s (as real measurements are not)."""
    fwd = tuple(tuple(scale * (1e-3 * b ** 0.9 + 3e-6 * s + 1e-4 * (b == 2)) for s in LENS) for b in MBS)
    bwd = tuple(tuple(2.1 * v for v in row) for row in fwd)
    return ComponentTable(MBS, LENS, fwd, bwd, optimizer_s)


TABLES = {t: {c: table((1.0 + i) / t, optimizer_s=1e-3 * (i + 1) / t) for i, c in enumerate(COMPONENTS)}
          for t in (1, 2)}


def gpu_profile(name: str = "gpu", **measured: object):
    base = spec_profile(name, peak_tflops=100, hbm_bandwidth_gbs=1000, memory_gib=80, note="test")
    mm = MeasuredModel(TINY.hidden_size, TINY.ffn_hidden_size, TINY.num_heads, TINY.num_kv_heads, TINY.vocab_size,
                       micro_batch=1, seq_lens=LENS, tp={}, **{"tables": TABLES, "includes_tp_comm": True, **measured})
    return dataclasses.replace(base, provenance="imported", models={"tiny": mm})


def two_nodes(types: tuple[str, str] = ("gpu", "gpu")) -> Cluster:
    dts = {t: DeviceType(80, 100, 1000, 100) for t in set(types)}
    return Cluster("two", dts, (Node("n0", types[0], 4), Node("n1", types[1], 4)), inter_node_bandwidth_gbs=10)


def cm_at(b: int, s: int, profile=None, cluster=None) -> CostModel:
    cluster = cluster or two_nodes()
    profile = profile or gpu_profile()
    return CostModel(TINY, cluster, {t: dataclasses.replace(profile, device_type=t) for t in cluster.device_types},
                     micro_batch=b, seq_len=s, step_allreduce=False)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("b", MBS)
@pytest.mark.parametrize("si", range(len(LENS)))
def test_every_table_point_reproduced_exactly(tp: int, b: int, si: int):
    s = LENS[si]
    cm = cm_at(b, s)
    comps = cm.components("gpu", tp)
    bi = MBS.index(b)
    for c in COMPONENTS:
        assert eval_fit(comps[c].forward_s, b, s) == TABLES[tp][c].forward_s[bi][si]
        assert eval_fit(comps[c].backward_s, b, s) == TABLES[tp][c].backward_s[bi][si]
    # A whole stage: its layers' and extras' table times summed, no TP overhead (includes_tp_comm).
    fwd = {c: TABLES[tp][c].forward_s[bi][si] for c in COMPONENTS}
    bwd = {c: TABLES[tp][c].backward_s[bi][si] for c in COMPONENTS}
    st = cm.stage("gpu", tp, 3, True, True)
    layer_f = fwd["attention"] + fwd["mlp"] + 2 * fwd["norm"]
    layer_b = bwd["attention"] + bwd["mlp"] + 2 * bwd["norm"]
    assert st.tp_comm_s == 0.0
    assert st.forward_s == pytest.approx(3 * layer_f + fwd["embedding"] + fwd["norm"] + fwd["head"], rel=1e-12)
    assert st.backward_s == pytest.approx(3 * layer_b + bwd["embedding"] + bwd["norm"] + bwd["head"], rel=1e-12)


def test_between_points_bilinear():
    t = TABLES[1]["mlp"]
    cm = cm_at(3, 192)
    got = eval_fit(cm.components("gpu", 1)["mlp"].forward_s, 3, 192)
    # B = 3 halfway between 2 and 4, s = 192 halfway between 128 and 256.
    expect = (t.forward_s[1][0] + t.forward_s[1][1] + t.forward_s[2][0] + t.forward_s[2][1]) / 4
    assert got == pytest.approx(expect, rel=1e-12)


def test_beyond_the_grid_scaled_by_the_reference_fit():
    prof = gpu_profile()
    cm = cm_at(8, 512, prof)
    ref = analytic_components(TINY, prof.compute, 1)["attention"]
    edge = TABLES[1]["attention"].forward_s[-1][-1]          # clamped to (4, 256)
    expect = edge * eval_fit(ref.forward_s, 8, 512) / eval_fit(ref.forward_s, 4, 256)
    assert eval_fit(cm.components("gpu", 1)["attention"].forward_s, 8, 512) == pytest.approx(expect, rel=1e-12)


def test_unmeasured_tp_degree_scaled_from_the_nearest_and_pays_its_collectives():
    prof = gpu_profile()
    cm = cm_at(2, 256, prof)
    ref4, ref2 = (analytic_components(TINY, prof.compute, t)["mlp"] for t in (4, 2))
    expect = TABLES[2]["mlp"].backward_s[1][1] * eval_fit(ref4.backward_s, 2, 256) / eval_fit(ref2.backward_s, 2, 256)
    assert eval_fit(cm.components("gpu", 4)["mlp"].backward_s, 2, 256) == pytest.approx(expect, rel=1e-12)
    assert cm.stage("gpu", 2, 2, False, False).tp_comm_s == 0.0   # measured TP degree: included
    assert cm.stage("gpu", 4, 2, False, False).tp_comm_s > 0.0    # scaled from TP 2: counted


def test_without_includes_tp_comm_the_collectives_are_counted():
    cm = cm_at(1, 128, gpu_profile(includes_tp_comm=False))
    assert cm.stage("gpu", 2, 2, False, False).tp_comm_s > 0.0


def test_per_layer_override_replaces_that_layer_only():
    first = table(5.0)
    cm = cm_at(2, 256, gpu_profile(layers={0: {1: {"attention": first}}}))
    shared = cm.stage("gpu", 1, 3, True, False)
    base = TABLES[1]["attention"]
    d_f = first.forward_s[1][1] - base.forward_s[1][1]
    d_b = first.backward_s[1][1] - base.backward_s[1][1]
    with_first = cm.placed_stage("gpu", 1, ((0, 3),), True, False)
    assert with_first.forward_s == pytest.approx(shared.forward_s + d_f, rel=1e-12)
    assert with_first.backward_s == pytest.approx(shared.backward_s + d_b, rel=1e-12)
    assert cm.placed_stage("gpu", 1, ((1, 4),), False, False) == cm.stage("gpu", 1, 3, False, False)
    rec = cm.placed_stage("gpu", 1, ((0, 3),), True, False, True)   # recompute re-runs the first layer's forward
    assert rec.backward_s == pytest.approx(cm.stage("gpu", 1, 3, True, False, True).backward_s + d_f + d_b, rel=1e-12)


def test_optimizer_seconds_from_the_tables():
    cm = cm_at(1, 128)
    s = Strategy("pp", (Pipeline(4, (Stage((0, 1), (0, 1)), Stage((4, 5), (1, 2)))),))
    opt = {c: TABLES[2][c].optimizer_s for c in COMPONENTS}
    first = opt["attention"] + opt["mlp"] + 2 * opt["norm"] + opt["embedding"]
    last = opt["attention"] + opt["mlp"] + 2 * opt["norm"] + opt["norm"] + opt["head"]
    times = cm.optimizer_times(s)
    assert times[0] == times[1] == pytest.approx(first, rel=1e-12)
    assert times[4] == times[5] == pytest.approx(last, rel=1e-12)


def test_link_curves_by_size_and_direction():
    sizes, bws = (1024, 1 << 20, 1 << 26), (0.1, 2.0, 8.0)
    slow_send = LinkCurve(sizes, bws)
    a = dataclasses.replace(gpu_profile("a"), comm=dataclasses.replace(
        gpu_profile().comm, links={"inter": LinkCurves(send=slow_send)}))
    b = dataclasses.replace(gpu_profile("b"), device_type="b")
    cluster = two_nodes(("a", "b"))
    cm = CostModel(TINY, cluster, {"a": a, "b": b}, micro_batch=1, seq_len=128)
    for n, bw in zip(sizes, bws):
        assert cm.transfer_time(0, 4, n) == pytest.approx(n / (bw * 1e9), rel=1e-12)   # a sends: its curve
    # b -> a: no curve on b's send side nor a's recv side: the link's latency + bytes / bandwidth.
    lk = cm.link(4, 0)
    assert cm.transfer_time(4, 0, 1 << 20) == pytest.approx(lk.latency_s + (1 << 20) / (lk.bandwidth_gbs * 1e9))
    # Between sizes: linear in time; below the smallest: its time; above the largest: its bandwidth.
    mid = (sizes[0] + sizes[1]) / 2
    assert cm.transfer_time(0, 4, mid) == pytest.approx((sizes[0] / 0.1e9 + sizes[1] / 2e9) / 2, rel=1e-12)
    assert cm.transfer_time(0, 4, 10) == pytest.approx(sizes[0] / 0.1e9, rel=1e-12)
    assert cm.transfer_time(0, 4, 1 << 28) == pytest.approx((1 << 28) / 8e9, rel=1e-12)


def test_round_trip_with_tables_curves_and_overrides(tmp_path: Path):
    p = gpu_profile(layers={0: {1: {"attention": table(2.0)}}})
    p = dataclasses.replace(p, iteration_s=0.002, comm=dataclasses.replace(
        p.comm, serialised_send_recv=True, links={"inter": LinkCurves(LinkCurve((1, 2), (1.0, 2.0)))},
        allreduce_curves={"inter": {4: LinkCurve((10, 20), (1.0, 3.0))}}))
    save_profile(p, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml") == p


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(seq_lens=[256, 128]), "tables.1.mlp.seq_lens: must be strictly increasing"),
    (lambda t: t["forward_s"].pop(), "tables.1.mlp.forward_s: expected 3 rows (one per micro-batch size), got 2"),
    (lambda t: t["backward_s"][0].append(1.0),
     "tables.1.mlp.backward_s[0]: expected 2 values (one per sequence length), got 3"),
    (lambda t: t.update(optimizer_s=-1.0), "tables.1.mlp.optimizer_s: must be a non-negative number, got -1.0"),
])
def test_bad_table_names_the_field(tmp_path: Path, edit, message):
    path = tmp_path / "p.yaml"
    save_profile(gpu_profile(), path)
    data = yaml.safe_load(path.read_text())
    edit(data["models"]["tiny"]["tables"][1]["mlp"])
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_profile(path)
    assert [str(p) for p in err.value.problems] == [f"{path}: models.tiny.{message}"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=6, max_size=6), st.floats(0.5, 5.0), st.floats(100.0, 300.0))
def test_bilinear_stays_within_its_cell_and_hits_the_points(values, b, s):
    grid = (tuple(values[0:2]), tuple(values[2:4]), tuple(values[4:6]))
    t = ComponentTable(MBS, LENS, grid, grid)
    bc, sc = t.clamp(b, s)
    v = t.value(bc, sc, backward=False)
    assert min(values) - 1e-9 <= v <= max(values) + 1e-9
    for i, mb in enumerate(MBS):
        for j, sl in enumerate(LENS):
            assert t.value(mb, sl, backward=True) == grid[i][j]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1 << 30), st.floats(0.01, 100.0)), min_size=1, max_size=6,
                unique_by=lambda x: x[0]), st.floats(1.0, float(1 << 31)))
def test_link_curve_exact_at_sizes_and_continuous_past_the_last(points, nbytes):
    points = sorted(points)
    curve = LinkCurve(tuple(p[0] for p in points), tuple(p[1] for p in points))
    for n, bw in points:
        assert curve.seconds(n) == pytest.approx(n / (bw * 1e9), rel=1e-12)
    assert curve.seconds(nbytes) >= 0
    last_n, last_bw = points[-1]
    assert curve.seconds(last_n * (1 + 1e-9)) == pytest.approx(last_n / (last_bw * 1e9), rel=1e-6)

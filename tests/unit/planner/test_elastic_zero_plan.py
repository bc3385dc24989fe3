"""The planner's side of elastic ZeRO-1 (r copies of every moment chunk): its price in the cost model, and
``hspmd plan --elastic`` choosing between ZeRO-1 with 2 copies and no ZeRO."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from planner.api import PlanSettings, plan
from planner.cost import CostModel, zero_degree
from runtime.torchfree.profiling.profile import resolve_profiles
from runtime.torchfree.spec import load_cluster, load_model, load_plan_context
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

# Two decoder layers cap a pipeline at two stages, so deeper pipelines cannot stand in for ZeRO's saving;
# one device per node, so no TP either. Without ZeRO a stage holds ~7.4 GiB at its peak, with two copies
# of each moment chunk over four pipelines ~6.2 GiB: at 7 GiB only the latter fits.
MODEL = """name: llama-2l
num_layers: 2
hidden_size: 4096
ffn_hidden_size: 11008
num_heads: 32
num_kv_heads: 32
vocab_size: 32000
max_seq_len: 4096
"""


def cluster_yaml(memory_gib: float) -> str:
    nodes = "".join(f"  - {{name: n{i}, device_type: RTX4090, count: 1}}\n" for i in range(8))
    return ("name: one-per-node-8\ndescription: eight single-device nodes\ndevice_types:\n"
            f"  RTX4090: {{memory_gib: {memory_gib}, peak_bf16_tflops: 165, hbm_bandwidth_gbs: 1000, "
            "intra_node_bandwidth_gbs: 25}\ninter_node_bandwidth_gbs: 25\nnodes:\n" + nodes)


@pytest.mark.parametrize("pipelines, copies, degree", [(4, 0, 1), (4, False, 1), (4, True, 4), (4, 1, 4), (4, 2, 2),
                                                        (5, 2, 2), (3, 2, 1), (2, 2, 1), (8, 3, 2)])
def test_zero_degree_is_the_chunks_per_slice(pipelines: int, copies: int, degree: int) -> None:
    assert zero_degree(pipelines, copies) == degree


def test_two_copies_double_the_moments_and_leave_the_all_gather() -> None:
    m, c = load_model("llama-7b"), load_cluster("h20-32")
    cm = CostModel(m, c, resolve_profiles(c.device_types), micro_batch=1, seq_len=2048)
    strategy = Strategy("dp4", tuple(Pipeline(4, (Stage(tuple(range(8 * i, 8 * i + 8)), ((0, 32),)),))
                                     for i in range(4)))
    plain, r2, off = (cm.estimate(strategy, 16, "1f1b", z) for z in (1, 2, 0))
    for d in strategy.devices:
        assert r2.memory[d].optimizer == pytest.approx(2 * plain.memory[d].optimizer)
        assert r2.memory[d].optimizer == pytest.approx(off.memory[d].optimizer / 2)
        assert r2.memory[d].params == plain.memory[d].params
    assert r2.extra["zero_gather_s"] == pytest.approx(plain.extra["zero_gather_s"])
    assert plain.extra["zero_gather_s"] > 0
    assert off.extra["zero_gather_s"] == 0
    assert off.step_time_s < r2.step_time_s  # the all-gather is paid, the AdamW step shrinks less than it costs


def test_elastic_plan_takes_zero_with_two_copies_where_only_it_fits(tmp_path) -> None:
    (tmp_path / "llama-2l.yaml").write_text(MODEL)
    (tmp_path / "tight.yaml").write_text(cluster_yaml(7))
    out = tmp_path / "plan.yaml"
    res = CliRunner().invoke(cli, ["plan", "--model", str(tmp_path / "llama-2l.yaml"), "--cluster",
                                   str(tmp_path / "tight.yaml"), "--global-batch", "32", "--seq-len", "1024",
                                   "--elastic", "--time-limit", "10", "--memory-margin", "0", "--out", str(out),
                                   "--format", "json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["zero_choice"].startswith("elastic: ZeRO-1 with 2 copies of each moment chunk; "
                                          "no plan without ZeRO fits")
    ctx = load_plan_context(out)  # valid: 2 copies over >= 2 pipelines
    t = ctx.plan.training
    assert (t.zero, t.zero_redundancy) == (True, 2)
    assert len(ctx.plan.strategies[0].pipelines) >= 4  # fewer would hold every moment twice: no saving


def test_elastic_plan_keeps_the_faster_of_the_two() -> None:
    m, c = load_model("llama-tiny"), load_cluster("cpu-hetero4")
    profiles = resolve_profiles(c.device_types)
    settings = PlanSettings(global_batch=8, seq_len=64, elastic=True, time_limit_s=20.0, top_k=1)
    auto = plan(m, c, profiles, settings, baselines=False)
    times = {z: plan(m, c, profiles, PlanSettings(global_batch=8, seq_len=64, elastic=True, use_zero=z,
                                                  time_limit_s=10.0, top_k=1), baselines=False).best.step_time_s
             for z in (False, True)}
    assert auto.best.step_time_s == pytest.approx(min(times.values()))
    faster = min(times, key=times.get)
    assert auto.to_plan("llama-tiny", "cpu-hetero4").training.zero is faster
    assert "beats" in auto.zero_choice

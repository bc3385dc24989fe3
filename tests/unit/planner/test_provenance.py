"""Plans say what they assumed: which profile priced each device type and what in it was measured; the
silent fallbacks (datasheet figures, a profile of another type or model, a partial table, per-layer
overrides) are said or refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli
from planner.provenance import component_source
from runtime.torchfree.profiling.profile import load_profile
from runtime.torchfree.spec.catalog import load_model, load_plan

BASE = {"embedding": 0.0002, "attention": 0.004, "mlp": 0.006, "norm": 0.0001, "head": 0.003}
CLUSTER = """name: a100x8
device_types:
  {name}: {{memory_gib: 80, peak_bf16_tflops: 312, hbm_bandwidth_gbs: 2039, intra_node_bandwidth_gbs: 300}}
nodes:
  - {{name: n0, device_type: {name}, count: 8}}
inter_node_bandwidth_gbs: 25
"""
PLAN = ["--model", "llama-7b", "--global-batch", "32", "--seq-len", "2048", "--time-limit", "3", "--check-top", "1",
        "--top-k", "1"]


def invoke(args: list[str]):
    return CliRunner().invoke(cli, [str(a) for a in args])


def rows_of(comp: str, layer: str, tp: int, t: float) -> list[str]:
    """One component's full grid (micro-batch 1, 2 x sequence 2048, 4096), time linear in the tokens."""
    return [f"compute,{comp},{layer},{tp},{b},{s},{t * b * s / 2048 / tp},{2 * t * b * s / 2048 / tp}"
            for b in (1, 2) for s in (2048, 4096)]


def table_rows(components=BASE, tps=(1,), layer0_factor: float | None = None, whole_layer: bool = False) -> str:
    rows = ["kind,component,layer,tp,micro_batch,seq_len,forward_s,backward_s"]
    for tp in tps:
        for comp, t in components.items():
            rows += rows_of(comp, "", tp, t)
        if whole_layer:
            rows += rows_of("layer", "", tp, BASE["attention"] + BASE["mlp"] + 2 * BASE["norm"])
    if layer0_factor is not None:
        for comp in ("attention", "mlp", "norm"):
            rows += rows_of(comp, "0", 1, BASE[comp] * layer0_factor)
    return "\n".join(rows) + "\n"


def imported(tmp: Path, name: str, csv: str, model: str = "llama-7b", device_type: str = "A100-80G"):
    d = tmp / name
    d.mkdir()
    (tmp / f"{name}.csv").write_text(csv)
    res = invoke(["profile", "import", tmp / f"{name}.csv", "--type", device_type, "--model", model, "--out",
                  d / f"{device_type}.imported.yaml"])
    assert res.exit_code == 0, res.output
    return d, res.output


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A plan of llama-7b on 8 A100-80G made with an imported profile; the profile with layer 0 100x slower."""
    tmp = tmp_path_factory.mktemp("prov")
    (tmp / "c.yaml").write_text(CLUSTER.format(name="A100-80G"))
    plain, _ = imported(tmp, "plain", table_rows())
    slow0, _ = imported(tmp, "slow0", table_rows(layer0_factor=100.0))
    res = invoke(["plan", *PLAN, "--cluster", tmp / "c.yaml", "--profile", plain, "-o", tmp / "plan.yaml",
                  "--format", "json"])
    assert res.exit_code == 0, res.output
    return tmp, plain, slow0, json.loads(res.output)


def test_plan_records_and_reports_the_profile_of_each_type(made):
    tmp, plain, _, out = made
    prof = out["profiles"]["A100-80G"]
    assert prof["provenance"] == "imported" and prof["path"] == str(plain / "A100-80G.imported.yaml")
    assert prof["measured"] and not prof["derived"]
    rec = load_plan(tmp / "plan.yaml").profiles["A100-80G"]
    assert rec.provenance == "imported" and rec.path == "plain/A100-80G.imported.yaml" and not rec.shipped


def test_a_type_priced_from_datasheet_figures_warns_and_suggests_the_shipped_name(tmp_path: Path):
    (tmp_path / "c.yaml").write_text(CLUSTER.format(name="A100-80GB"))
    res = invoke(["plan", *PLAN, "--cluster", tmp_path / "c.yaml", "--format", "json"])
    assert res.exit_code == 0, res.output
    assert "warning: device type 'A100-80GB'" in res.output and "did you mean A100-80G?" in res.output
    body = json.loads(res.output[res.output.index("{"):])
    assert body["profiles"]["A100-80GB"]["provenance"] == "datasheet"


def test_a_profile_directory_of_types_the_cluster_does_not_name_warns(made, tmp_path: Path):
    _, plain, _, _ = made
    (tmp_path / "c.yaml").write_text(CLUSTER.format(name="A100-80GB"))
    res = invoke(["plan", *PLAN, "--cluster", tmp_path / "c.yaml", "--profile", plain])
    assert res.exit_code == 0, res.output
    assert "A100-80G.imported.yaml is for device type 'A100-80G', which" in res.output and "not used" in res.output


def test_a_profile_measured_for_another_model_is_an_error_naming_the_fields(made):
    tmp, plain, _, _ = made
    res = invoke(["plan", "--model", "llama-3-8b", "--global-batch", "32", "--seq-len", "2048", "--cluster",
                  tmp / "c.yaml", "--profile", plain])
    assert res.exit_code == 2, res.output
    assert "measured for another model than llama-3-8b" in res.output
    assert "ffn_hidden_size 11008 (model 14336)" in res.output and "num_kv_heads 32 (model 8)" in res.output
    assert "hidden_size 4096" not in res.output.replace("ffn_hidden_size", "")   # only the fields that differ


def test_a_tp1_table_prices_tp2_as_scaled_and_says_so(made):
    _, plain, _, _ = made
    prof = load_profile(plain / "A100-80G.imported.yaml")
    model = load_model("llama-7b")
    assert component_source(prof, model, 1, "attention") == ("measured", None)
    assert component_source(prof, model, 2, "attention") == ("scaled", 1)
    assert component_source(prof, load_model("llama-3-8b"), 1, "attention") == ("derived", None)


def test_an_import_without_some_components_says_they_are_derived(tmp_path: Path):
    partial = {k: v for k, v in BASE.items() if k not in ("embedding", "head")}
    d, said = imported(tmp_path, "partial", table_rows(partial))
    assert "note: llama-7b tp1: embedding, head derived from the profile's figures" in said
    shown = invoke(["profile", "show", d / "A100-80G.imported.yaml"])
    assert shown.exit_code == 0 and "derived" in shown.output
    js = json.loads(invoke(["profile", "show", d / "A100-80G.imported.yaml", "--format", "json"]).output)
    assert js["unmeasured"]["llama-7b"]["1"] == {"embedding": "derived", "head": "derived"}


def test_a_whole_layer_row_is_split_keeping_its_total(tmp_path: Path):
    d, said = imported(tmp_path, "whole", table_rows({"embedding": BASE["embedding"], "head": BASE["head"]},
                                                      whole_layer=True))
    assert "whole-layer rows split" in said
    m = load_profile(d / "A100-80G.imported.yaml").measured_model(load_model("llama-7b"))
    t = m.tables[1]
    for i, b in enumerate(t["attention"].micro_batches):
        for j, s in enumerate(t["attention"].seq_lens):
            total = sum(k * t[c].forward_s[i][j] for c, k in (("attention", 1), ("mlp", 1), ("norm", 2)))
            layer = (BASE["attention"] + BASE["mlp"] + 2 * BASE["norm"]) * b * s / 2048
            assert total == pytest.approx(layer, rel=1e-9)
    assert t["mlp"].forward_s[0][0] > t["attention"].forward_s[0][0] > t["norm"].forward_s[0][0] > 0


def test_a_whole_layer_row_beside_its_components_is_refused(tmp_path: Path):
    (tmp_path / "both.csv").write_text(table_rows(whole_layer=True))
    res = invoke(["profile", "import", tmp_path / "both.csv", "--type", "A100-80G", "--model", "llama-7b", "--out",
                  tmp_path / "x.yaml"])
    assert res.exit_code == 2 and "whole-layer rows and attention, mlp, norm rows" in res.output, res.output
    assert not (tmp_path / "x.yaml").exists()


def test_a_per_layer_override_moves_the_estimate_and_the_simulation(made):
    tmp, plain, slow0, _ = made
    base = json.loads(invoke(["simulate", tmp / "plan.yaml", "--profile", plain, "--format", "json"]).output)
    res = invoke(["simulate", tmp / "plan.yaml", "--profile", slow0, "--format", "json"])
    assert res.exit_code == 0, res.output
    slow = json.loads(res.output[res.output.index("{"):])
    assert slow["formula_step_time_s"] > 2 * base["formula_step_time_s"]
    assert slow["step_time_s"] > 2 * base["step_time_s"]


def test_simulate_warns_when_its_estimate_drifts_from_the_plans_and_says_why(made):
    tmp, plain, _, _ = made
    same = invoke(["simulate", tmp / "plan.yaml", "--profile", plain])
    assert same.exit_code == 0 and "warning" not in same.output, same.output
    res = invoke(["simulate", tmp / "plan.yaml"])
    assert res.exit_code == 0, res.output
    assert "differs from the plan's recorded estimate" in res.output
    assert "was priced by its imported profile (plain/A100-80G.imported.yaml)" in res.output
    assert f"--profile {plain}" in res.output


def test_profile_show_of_an_unknown_name_lists_the_shipped_ones_and_the_nearest():
    res = invoke(["profile", "show", "A100-80GB"])
    assert res.exit_code == 2 and "did you mean A100-80G?" in res.output and "H100" in res.output, res.output

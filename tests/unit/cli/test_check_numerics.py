"""check-numerics: per component and dtype against fp64; a wrong kernel is flagged."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from click.testing import CliRunner

from hetu_cli.main import cli
from runtime.models.llama import apply_rope
from runtime.profiling.numerics import TOLERANCES, NumericsSettings, check_numerics
from runtime.torchfree.profiling.profile import COMPONENTS
from runtime.torchfree.spec import load_model

SPEC = load_model("llama-tiny")
SMALL = NumericsSettings(batch=1, seq_len=16)


def non_causal_attention(attn, args):
    """LlamaAttention's forward with the causal mask forgotten: a plausible wrong kernel."""
    x, cos, sin = args
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, s, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=q.shape[1] != k.shape[1])
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def test_every_component_and_dtype_is_within_tolerance():
    results = check_numerics(SPEC, ["cpu"], ["fp32", "bf16"], SMALL)
    assert [(r.component, r.dtype) for r in results] == [(c, d) for c in COMPONENTS for d in ("fp32", "bf16")]
    for r in results:
        assert not r.flagged, r
        assert r.tolerance == TOLERANCES[r.dtype]
    # fp32 is far closer to fp64 than bf16 is: the errors measure rounding, not noise of the harness.
    by = {(r.component, r.dtype): r for r in results}
    for c in COMPONENTS:
        assert by[(c, "fp32")].backward_error < by[(c, "bf16")].backward_error / 100
        assert by[(c, "bf16")].backward_error > 1e-4


def test_a_wrong_attention_kernel_is_flagged_and_nothing_else():
    results = check_numerics(SPEC, ["cpu"], ["fp32", "bf16"], SMALL,
                             kernels={"attention": non_causal_attention})
    flagged = {(r.component, r.dtype) for r in results if r.flagged}
    assert flagged == {("attention", "fp32"), ("attention", "bf16")}
    worst = [r for r in results if r.component == "attention"]
    assert all(r.forward_error > 10 * r.tolerance for r in worst)


def test_a_slightly_perturbed_kernel_is_flagged_in_fp32_only():
    def scaled(module, args):  # 1% off: far outside fp32's tolerance, inside bf16's (4%)
        return module(*args) * 1.01

    results = check_numerics(SPEC, ["cpu"], ["fp32", "bf16"], SMALL, kernels={"mlp": scaled}, components=["mlp"])
    assert [(r.dtype, r.flagged) for r in results] == [("fp32", True), ("bf16", False)]
    assert abs(results[0].forward_error - 0.01) < 1e-4


def test_cli_json_and_table():
    r = CliRunner().invoke(cli, ["check-numerics", "--types", "cpu", "--dtypes", "fp32,bf16", "--seq-len", "16",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["ok"] and out["reference"] == "cpu fp64" and out["flagged"] == []
    assert {(x["component"], x["dtype"]) for x in out["results"]} == {(c, d) for c in COMPONENTS
                                                                      for d in ("fp32", "bf16")}
    r = CliRunner().invoke(cli, ["check-numerics", "--dtypes", "bf16", "--seq-len", "8"])
    assert r.exit_code == 0 and "every component within tolerance" in r.output, r.output


def test_cli_refuses_components_too_large_for_an_fp64_check(tmp_path):
    huge = tmp_path / "huge.yaml"
    huge.write_text((Path(__file__).resolve().parents[3] / "configs" / "models" / "llama-tiny.yaml").read_text()
                    .replace("ffn_hidden_size: 128", "ffn_hidden_size: 8000000"))
    r = CliRunner().invoke(cli, ["check-numerics", "--model", str(huge)])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "--model: llama-tiny: an MLP weight has 512,000,000 elements, more than the 268,435,456" in r.output


def test_cli_refuses_attention_too_large_for_an_fp64_check(tmp_path):
    """head_dim 10**6 made 5e8-element attention projections that the size check did not count: check-numerics
    allocated and initialised them for minutes."""
    huge = tmp_path / "wide.yaml"
    huge.write_text((Path(__file__).resolve().parents[3] / "configs" / "models" / "llama-tiny.yaml").read_text()
                    + "head_dim: 1000000\n")
    r = CliRunner().invoke(cli, ["check-numerics", "--model", str(huge), "--seq-len", "8"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "--model: llama-tiny: an attention projection has 512,000,000 elements, more than the 268,435,456" \
        in r.output


def test_cli_bad_input_is_exit_2():
    for argv, msg in ((["--types", "tpu"], "--types: expected a comma-separated list of cpu"),
                      (["--dtypes", "fp8"], "--dtypes: expected a comma-separated list of fp32, bf16, fp16"),
                      (["--seq-len", "9999"], "--seq-len: 9999 exceeds llama-tiny's max_seq_len 256"),
                      (["--model", "nope"], "--model: unknown model 'nope'")):
        r = CliRunner().invoke(cli, ["check-numerics", *argv])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(cli, ["check-numerics", "--types", "cpu,cuda"])
        assert r.exit_code == 2 and "got 'cpu,cuda'" in r.output


def test_cli_flags_and_exits_3(monkeypatch):
    import runtime.profiling.numerics as numerics

    monkeypatch.setitem(numerics.TOLERANCES, "fp32", 1e-12)  # tighter than fp32 rounding itself
    r = CliRunner().invoke(cli, ["check-numerics", "--dtypes", "fp32,bf16", "--seq-len", "8", "--format", "json"])
    assert r.exit_code == 3, r.output
    out = json.loads(r.output)
    assert not out["ok"] and out["flagged"] == [f"cpu fp32 {c}" for c in COMPONENTS]
    assert not any(x["flagged"] for x in out["results"] if x["dtype"] == "bf16")
    r = CliRunner().invoke(cli, ["check-numerics", "--dtypes", "fp32", "--seq-len", "8"])
    assert r.exit_code == 3 and "FLAGGED" in r.output and "outside tolerance" in r.output

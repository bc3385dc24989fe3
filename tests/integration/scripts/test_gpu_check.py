"""scripts/gpu_check.sh: the dry run (CPU, gloo, bf16 autocast) goes through every phase; without a GPU the
real mode records why, phase by phase, instead of stopping."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.data import token_source
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.spec import load_cluster, load_plan_context

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.integration


def run(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(SCRIPT), *args, "--python", sys.executable, "--out", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    return p.returncode, json.loads((out / "summary.json").read_text()), p.stderr


def test_dry_run_goes_through_every_phase(tmp_path):
    rc, s, err = run(tmp_path, "--dry-run")
    assert rc == 0 and s["ok"], err
    phases = s["phases"]
    plans = tuple(phases["plans"]["plans"])
    assert {"one-device", "two-stage-1f1b", "interleaved-2x2", "zb-v", "dp2-zero1", "tp2-pp2", "moe-one-device",
            "moe-ep2"} <= set(plans)
    cuda_only = ["build-memory", "attention-kernels"]   # what only a GPU can show: skipped, saying why
    expected = ["install", "environment", "cluster", "model", "numerics", "plans", "reference", "checkpoint",
                "documents", "profile", "elastic", *(f"{p}:{n}" for n in plans for p in ("train", "losses")),
                *(f"{p}:{n}" for n in plans for p in ("mfu", "simulate"))]
    assert sorted(phases) == sorted(expected + cuda_only), list(phases)
    assert all(phases[n]["status"] == "ok" for n in expected), {n: phases[n] for n in expected}
    assert all(phases[n]["status"] == "skipped" and phases[n]["reason"] for n in cuda_only)
    assert s["mode"] == "dry-run" and phases["environment"]["backend"] == "gloo"

    # The generated cluster is a valid (emulated) cluster of the dry run's devices.
    cluster = load_cluster(phases["cluster"]["path"])
    assert cluster.num_devices == phases["environment"]["count"] and cluster.emulated

    # The reference the script compared with is the single-process CPU fp32 reference of the same plan.
    ctx = load_plan_context(phases["plans"]["plans"]["two-stage-1f1b"])
    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t, precision="fp32")
    source = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch, seq_len=t.seq_len,
                          seed=t.seed)
    ref = [trainer.train_step(source.batch(k)).loss for k in range(1, s["sizes"]["steps"] + 1)]
    assert phases["reference"]["losses"] == pytest.approx(ref, rel=1e-6)
    for name in plans:
        train = phases[f"train:{name}"]
        assert len(train["losses"]) == s["sizes"]["steps"]   # trained under --precision bf16
        want = phases["reference"]["losses_moe" if name.startswith("moe-") else "losses"]
        assert train["losses"] != want  # bf16 autocast really ran: its rounding shows ...
        cmp = phases[f"losses:{name}"]
        assert cmp["ok"] and all(r["rel_diff"] <= r["tolerance"] for r in cmp["steps"])  # ... within tolerance
        assert 0 < phases[f"mfu:{name}"]["mfu_datasheet"] < 1
        sim = phases[f"simulate:{name}"]
        assert sim["simulated_step_time_s"] > 0 and sim["measured_step_time_s"] > 0
        assert sim["rel_error"] == pytest.approx(sim["simulated_step_time_s"] / sim["measured_step_time_s"] - 1)
    assert "measured" in json.dumps(phases["simulate:one-device"]["profiles"])  # the new profile was used
    assert not phases["numerics"]["flagged"]


def test_without_a_gpu_the_real_mode_says_why_phase_by_phase(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real mode would run")
    rc, s, err = run(tmp_path)
    assert rc == 1 and not s["ok"]
    phases = s["phases"]
    assert phases["environment"]["status"] == "failed"
    assert "GPU" in phases["environment"]["reason"] or "CUDA" in phases["environment"]["reason"]
    for name in ("cluster", "numerics", "plans", "reference", "profile"):
        assert phases[name]["status"] == "skipped" and "needs phase(s)" in phases[name]["reason"], (name, phases[name])
    assert phases["model"]["status"] == "ok"
    assert not any(n.startswith("train:") for n in phases)

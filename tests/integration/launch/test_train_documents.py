"""``hspmd train`` on mixed-length documents, end to end: per-step dispatch on every worker, a switch between
the plan's strategies, the metrics of each step, and the numbers of the reference that runs each document
alone (the documents recomputed here from the run's own source: a pure function of seed and step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from oracles import train_documents
from train_helpers import REPO

from runtime.engine.reference import ReferenceTrainer
from runtime.launch.options import TrainOptions
from runtime.launch.session import document_source_of
from runtime.torchfree.spec import load_plan_context

PLAN = REPO / "tests" / "integration" / "engine_plans" / "lengths-two.yaml"
HISTOGRAM = "scale: tokens\nbins:\n  - {lo: 2, hi: 16, weight: 96}\n  - {lo: 17, hi: 64, weight: 4}\n"
STEPS = 3


def test_documents_run_switches_strategy_and_matches_the_reference(tmp_path: Path):
    hist = tmp_path / "lengths.yaml"
    hist.write_text(HISTOGRAM)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(PLAN), "--lengths", str(hist),
                           "--steps", str(STEPS), "--metrics", str(metrics)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "strategies 'short', 'long'" in proc.stdout
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [x for x in lines if "event" not in x]
    events = [x for x in lines if "event" in x]
    ctx = load_plan_context(PLAN)
    source = document_source_of(ctx, TrainOptions(plan=PLAN, lengths=str(hist)))
    docs = [source.documents(k) for k in range(1, STEPS + 1)]
    # step 1 holds only short documents, step 2 one that only `long` serves: dispatch must switch there
    assert max(docs[0].lengths) <= 16 < max(docs[1].lengths)
    assert steps[0]["strategy"] == "short" and steps[1]["strategy"] == "long"
    # every device of `short` holds a full replica, so the switch to `long` is local copies only (no bytes sent)
    assert steps[1]["switched_from"] == "short" and steps[1]["switch_bytes"] == 0 and steps[1]["switch_s"] > 0
    assert [e["step"] for e in events] == [2] and events[0]["from"] == "short" and events[0]["to"] == "long"
    for x, d in zip(steps, docs):
        assert x["documents"] == len(d.documents) and x["tokens"] == ctx.plan.training.tokens_per_step
        assert x["padding_fraction"] == 0.0 and x["imbalance"] >= 1.0 and x["dispatch_method"] in ("ilp", "greedy")
    trainer = ReferenceTrainer(ctx.model, ctx.plan.training)
    ref = [train_documents(trainer, [doc.tokens for doc in d.documents]) for d in docs]
    torch.testing.assert_close([x["loss"] for x in steps], [r.loss for r in ref], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([x["grad_norm"] for x in steps], [r.grad_norm for r in ref], rtol=1e-4, atol=1e-6)


def test_dispatch_costs_profiles_dispatch_as_the_simulator_plays(tmp_path: Path):
    """``--dispatch-costs profiles``: every step's strategy and predicted makespan are ``hspmd simulate
    --lengths``'s for the same steps (one cost model on both sides), and the numbers are still the reference's."""
    hist = tmp_path / "lengths.yaml"
    hist.write_text(HISTOGRAM)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hetu_cli", "train", "--plan", str(PLAN), "--lengths", str(hist),
                           "--steps", str(STEPS), "--metrics", str(metrics), "--dispatch-costs", "profiles"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    steps = [x for x in map(json.loads, metrics.read_text().splitlines()) if "event" not in x]
    sim = subprocess.run([sys.executable, "-m", "hetu_cli", "simulate", "--plan", str(PLAN), "--lengths", str(hist),
                          "--steps", str(STEPS), "--format", "json"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert sim.returncode == 0, sim.stderr
    played = json.loads(sim.stdout)["steps"]
    assert [x["strategy"] for x in steps] == [x["strategy"] for x in played]
    for x, p in zip(steps, played):
        assert x["predicted_s"] == p["compute_s"]
    ctx = load_plan_context(PLAN)
    source = document_source_of(ctx, TrainOptions(plan=PLAN, lengths=str(hist)))
    trainer = ReferenceTrainer(ctx.model, ctx.plan.training)
    ref = [train_documents(trainer, [doc.tokens for doc in source.documents(k).documents]) for k in range(1, STEPS + 1)]
    torch.testing.assert_close([x["loss"] for x in steps], [r.loss for r in ref], rtol=1e-5, atol=1e-6)

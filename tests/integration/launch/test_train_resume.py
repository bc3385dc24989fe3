"""``hspmd train --save-every`` and ``--resume``: a job SIGKILLed mid-step and resumed trains exactly the
losses and parameters of an uninterrupted run (bit for bit under the same plan; at the engine tests'
tolerances under another plan), and what the kill left is a complete ``latest``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from train_helpers import HETERO_PLAN, PARAM_ATOL, REPO, shrink, write_plan

from runtime.checkpoint import checkpoint_info, latest_checkpoint, read_saved
from runtime.checkpoint_series import read_trainer_state, step_of
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan

STEPS, EVERY, KILLED_IN = 12, 4, 7


def scheduled(path: Path) -> Path:
    """Warmup then cosine decay over the run: every step at its own learning rate."""
    plan = load_plan(path)
    opt = replace(plan.training.optimizer, warmup_steps=3, decay="cosine", decay_steps=8, min_lr=1e-4)
    save_plan(replace(plan, training=replace(plan.training, optimizer=opt)), path)
    return path


def train(plan: Path, save: Path, metrics: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", str(STEPS), "--save",
           str(save), "--save-every", str(EVERY), "--metrics", str(metrics), *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: the whole job is killed at once
    if wait:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
    return proc


def losses(metrics: Path) -> dict[int, float]:
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    for r in records:   # every step's observability: MFU and each device's peak memory
        assert r["mfu"] > 0 and set(r["peak_memory_bytes"]) <= {"0", "1", "2", "3"}
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run, and a run SIGKILLed (launcher and every worker) during step 7."""
    d = tmp_path_factory.mktemp("resume")
    plan = scheduled(shrink(HETERO_PLAN, d / "hetero.yaml"))
    train(plan, d / "full", d / "full.jsonl")
    killed = d / "killed"
    # Device 3 stops at the start of step 7 (SIGSTOP): the others are inside step 7, waiting on it.
    proc = train(plan, killed, d / "killed.jsonl", "--hang-device", "3", "--at-step", str(KILLED_IN), wait=False)
    try:
        deadline = time.monotonic() + 180
        while not (d / "killed.jsonl").exists() or KILLED_IN - 1 not in losses(d / "killed.jsonl") \
                or latest_checkpoint(killed) is None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the run never reached step 7"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return d, plan


def test_a_job_killed_mid_step_resumes_to_the_uninterrupted_losses_bit_for_bit(runs):
    d, plan = runs
    killed = d / "killed"
    latest = latest_checkpoint(killed)
    assert latest is not None and step_of(latest) == EVERY
    checkpoint_info(killed, load_plan_context(plan).model)  # complete: every tensor, one save id
    assert read_trainer_state(latest).step == EVERY
    backup = d / "killed-copy"
    shutil.copytree(killed, backup)

    before = losses(d / "killed.jsonl")
    assert max(before) == KILLED_IN - 1  # step 7 never finished
    train(plan, killed, d / "resumed.jsonl", "--resume")
    full, after = losses(d / "full.jsonl"), losses(d / "resumed.jsonl")
    assert sorted(after) == list(range(EVERY + 1, STEPS + 1))
    assert all(before[s] == full[s] for s in before)
    assert all(after[s] == full[s] for s in after)  # bit for bit
    a, meta_a = read_saved(d / "full")
    b, meta_b = read_saved(killed)
    assert meta_a["step"] == meta_b["step"] == str(STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in killed.iterdir()) == ["latest", "step-00000004", "step-00000008", "step-00000012"]

    # The same checkpoint resumed under another plan (one pipeline, another layer split, other devices),
    # its saves written in the foreground.
    other = write_plan(d / "other.yaml", "other", [(8, [([3], (0, 1)), ([1], (1, 6))])], global_batch=8)
    scheduled(other)
    train(other, backup, d / "other.jsonl", "--resume", "--save-in-foreground")
    assert latest_checkpoint(backup) == backup / "step-00000012" and (backup / "step-00000008").is_dir()
    crossed = losses(d / "other.jsonl")
    assert sorted(crossed) == list(range(EVERY + 1, STEPS + 1))
    assert [crossed[s] for s in crossed] == pytest.approx([full[s] for s in crossed], rel=1e-5)
    c, _ = read_saved(backup)
    for name, want in a.items():
        atol = 1e-5 * float(want.abs().max()) if name.endswith(("exp_avg", "exp_avg_sq")) else PARAM_ATOL
        torch.testing.assert_close(c[name], want, rtol=1e-5, atol=atol, msg=name)

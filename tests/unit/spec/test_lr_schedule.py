"""The learning-rate schedule (OptimizerSettings.lr_at): hand-computed rates, torch's own schedulers as the
second opinion, the optimizers and the reference stepping at it, and the plan fields' validation."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_files import problems

from runtime.engine.optim import LocalAdamW, build_adamw
from runtime.torchfree.spec import OptimizerSettings, load_plan_context
from runtime.torchfree.spec.schema import to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
BASE = yaml.safe_load((CONFIGS / "plans" / "cpu-hetero4-tiny.yaml").read_text())


def schedule(**kw) -> OptimizerSettings:
    return OptimizerSettings(lr=1e-3, **kw)


def test_rates_by_hand() -> None:
    warm = schedule(warmup_steps=4)
    assert [warm.lr_at(k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    lin = schedule(warmup_steps=2, decay="linear", decay_steps=10, min_lr=1e-4)
    # update 2 starts the decay at lr; update 7 is half-way: (1e-3 + 1e-4) / 2; from update 12 on, min_lr
    assert [lin.lr_at(k) for k in (0, 1, 2, 7, 11, 12, 10**6)] == pytest.approx(
        [5e-4, 1e-3, 1e-3, 5.5e-4, 1.9e-4, 1e-4, 1e-4])
    cos = schedule(decay="cosine", decay_steps=4, min_lr=2e-4)
    # 1e-3 at the start, cos(pi/4) a quarter of the way: 2e-4 + 8e-4 * (1 + 0.7071) / 2
    assert [cos.lr_at(k) for k in (0, 1, 2, 4, 9)] == pytest.approx(
        [1e-3, 2e-4 + 8e-4 * (1 + math.sqrt(0.5)) / 2, 6e-4, 2e-4, 2e-4])
    assert [OptimizerSettings(lr=1e-3).lr_at(k) for k in (0, 5, 10**9)] == [1e-3] * 3


def torch_rates(s: OptimizerSettings, steps: int) -> list[float]:
    """The same schedule from torch's schedulers: LinearLR warmup, then CosineAnnealingLR / LinearLR."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=s.lr)
    parts, milestones = [], []
    if s.warmup_steps >= 2:  # LinearLR over one iteration (total_iters 0) is not defined
        parts.append(torch.optim.lr_scheduler.LinearLR(opt, 1 / s.warmup_steps, 1.0, s.warmup_steps - 1))
        milestones.append(s.warmup_steps)
    if s.decay == "cosine":
        parts.append(torch.optim.lr_scheduler.CosineAnnealingLR(opt, s.decay_steps, s.min_lr))
    else:
        parts.append(torch.optim.lr_scheduler.LinearLR(opt, 1.0, s.min_lr / s.lr, s.decay_steps))
    sched = parts[0] if len(parts) == 1 else torch.optim.lr_scheduler.SequentialLR(opt, parts, milestones)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@settings(max_examples=60, deadline=None)
@given(warmup=st.sampled_from([0, 2, 3, 7]), decay=st.sampled_from(["linear", "cosine"]),
       decay_steps=st.integers(1, 20), min_frac=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_rates_equal_torch_schedulers(warmup: int, decay: str, decay_steps: int, min_frac: float) -> None:
    s = schedule(warmup_steps=warmup, decay=decay, decay_steps=decay_steps, min_lr=1e-3 * min_frac)
    # CosineAnnealingLR is periodic past T_max (ours stays at min_lr): compare warmup + decay, then the floor.
    steps = warmup + decay_steps + 1
    assert [s.lr_at(k) for k in range(steps)] == pytest.approx(torch_rates(s, steps), rel=1e-9, abs=1e-15)
    assert s.lr_at(steps + 100) == pytest.approx(s.min_lr, rel=1e-12, abs=1e-18)


@settings(max_examples=200, deadline=None)
@given(warmup=st.integers(0, 50), decay=st.sampled_from(["constant", "linear", "cosine"]),
       decay_steps=st.integers(1, 50), min_frac=st.floats(0, 1), step=st.integers(0, 200))
def test_rates_rise_then_fall_within_bounds(warmup: int, decay: str, decay_steps: int, min_frac: float,
                                            step: int) -> None:
    s = schedule(warmup_steps=warmup, decay=decay, **({} if decay == "constant" else
                                                       {"decay_steps": decay_steps, "min_lr": 1e-3 * min_frac}))
    lr, after = s.lr_at(step), s.lr_at(step + 1)
    assert 0 <= lr <= s.lr * (1 + 1e-12) and (lr > 0 or s.min_lr == 0)  # min_lr 0: decays to a stop
    if step + 1 < warmup:
        assert after > lr
    elif step >= warmup:
        assert s.min_lr * (1 - 1e-12) <= lr and after <= lr * (1 + 1e-12)


def test_local_adamw_steps_at_the_schedule_as_torch_does() -> None:
    """LocalAdamW with a schedule == torch's AdamW driven by torch's own schedulers."""
    s = OptimizerSettings(lr=1e-2, weight_decay=0.1, warmup_steps=3, decay="cosine", decay_steps=4, min_lr=1e-3)
    g = torch.Generator().manual_seed(3)
    full = torch.nn.Parameter(torch.randn(5, 4, generator=g))
    ref = build_adamw([full], s)
    rates = torch_rates(s, 8)  # warmup + decay + the floor (torch's cosine is periodic past that)
    mine = LocalAdamW({"w": full.detach().clone()}, s)
    used = []
    for k in range(8):
        grad = torch.randn(5, 4, generator=g)
        for group in ref.param_groups:
            group["lr"] = rates[k]
        full.grad = grad.clone()
        ref.step()
        used.append(mine.step({"w": grad.clone()}, None))
    assert used == pytest.approx(rates, rel=1e-9)
    torch.testing.assert_close(mine.state()["w"], full.detach(), rtol=1e-6, atol=1e-8)
    # A constant-rate run ends elsewhere: the schedule is not a no-op.
    flat = LocalAdamW({"w": torch.zeros(5, 4)}, OptimizerSettings(lr=1e-2))
    assert flat.step({"w": torch.ones(5, 4)}, None) == 1e-2 != used[0]


def test_resumed_optimizer_continues_the_schedule() -> None:
    """``load_state`` restores the step, so the rate continues where the saved run stopped."""
    s = OptimizerSettings(lr=1e-2, warmup_steps=4)
    a = LocalAdamW({"w": torch.zeros(3)}, s)
    for _ in range(2):
        a.step({"w": torch.ones(3)}, None)
    b = LocalAdamW({"w": torch.zeros(3)}, s)
    b.load_state({k: v.clone() for k, v in a.state().items()})
    assert b.step({"w": torch.ones(3)}, None) == pytest.approx(s.lr_at(2)) == pytest.approx(7.5e-3)


def test_plans_without_a_schedule_write_what_they_read() -> None:
    """The new fields are omitted where default: existing plans round-trip byte for byte."""
    assert set(to_data(OptimizerSettings())) == {"lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip"}
    s = schedule(warmup_steps=5, decay="linear", decay_steps=9, min_lr=0.0)
    assert to_data(s) | {"min_lr": 0.0} == {**to_data(OptimizerSettings(lr=1e-3)), "warmup_steps": 5,
                                            "decay": "linear", "decay_steps": 9, "min_lr": 0.0}


def with_optimizer(**kw) -> dict:
    data = copy.deepcopy(BASE)
    data["training"]["optimizer"].update(kw)
    return data


def test_plan_reads_a_schedule(tmp_path: Path) -> None:
    ctx = load_plan_context_of(tmp_path, with_optimizer(warmup_steps=10, decay="cosine", decay_steps=90,
                                                        min_lr=1e-5))
    o = ctx.plan.training.optimizer
    assert (o.warmup_steps, o.decay, o.decay_steps, o.min_lr) == (10, "cosine", 90, 1e-5)


def load_plan_context_of(tmp_path: Path, data: dict):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_plan_context(path)


BAD = {
    "unknown_decay": ({"decay": "exponential", "decay_steps": 5}, "training.optimizer.decay: "),
    "decay_without_steps": ({"decay": "cosine"}, "training.optimizer.decay_steps: decay 'cosine' needs"),
    "min_above_lr": ({"decay": "linear", "decay_steps": 5, "min_lr": 0.5},
                     "training.optimizer.min_lr: must be in [0, lr = 0.001], got 0.5"),
    "negative_warmup": ({"warmup_steps": -1}, "training.optimizer.warmup_steps: must be in [0, 100,000,000]"),
    "huge_decay": ({"decay": "linear", "decay_steps": 10**12},
                   "training.optimizer.decay_steps: must be in [0, 100,000,000]"),
    "fractional_warmup": ({"warmup_steps": 2.5}, "training.optimizer.warmup_steps: "),
    "floor_without_decay": ({"min_lr": 1e-5}, "training.optimizer.decay: is constant, so decay_steps and min_lr"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_schedules_are_refused_one_line_each(tmp_path: Path, case: str) -> None:
    edit, want = BAD[case]
    lines = problems(tmp_path, with_optimizer(**edit))
    assert len(lines) == 1 and lines[0].startswith(want), lines


def test_schedule_in_words() -> None:
    assert OptimizerSettings(lr=1e-3).schedule_text() == "lr 0.001"
    assert schedule(warmup_steps=20, decay="cosine", decay_steps=80, min_lr=1e-4).schedule_text() == \
        "lr 0.001 after a 20-step warmup, cosine decay to 0.0001 over 80 steps"

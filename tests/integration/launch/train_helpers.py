"""Shared by the launcher's integration tests: small plans and the single-process reference numbers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from oracles import optimizer_state

from runtime.data import TokenSource, token_source
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.spec import load_plan, load_plan_context, save_plan
from runtime.torchfree.spec.plan import Pipeline, Stage, Strategy

REPO = Path(__file__).resolve().parents[3]
HETERO_PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
# Adam divides by sqrt(v) + eps: with eps 1e-8 an entry whose gradient is fp32 rounding noise moves by
# up to a whole step, so two correct runs that sum in different orders drift apart. eps 1e-5 keeps
# that below 1e-3 of a step (as in the engine's correctness tests); a wrong gradient still moves O(lr).
EPS = 1e-5
PARAM_ATOL = 1e-3 * 1e-3  # 1e-3 of a step at lr 1e-3


def shrink(src: Path, dst: Path, *, seq_len: int = 16) -> Path:
    """A shipped plan with a short sequence (tests pay for start-up, not for compute)."""
    plan = load_plan(src)
    save_plan(replace(plan, model="llama-tiny", cluster="cpu-hetero4", training=_training(plan, seq_len=seq_len)),
              dst)
    return dst


def _training(plan, **changes):
    return replace(plan.training, optimizer=replace(plan.training.optimizer, lr=1e-3, eps=EPS), **changes)


def write_plan(dst: Path, name: str, pipelines: list[tuple[int, list[tuple[list[int], tuple[int, int]]]]], *,
               global_batch: int, micro_batch: int = 1, seq_len: int = 16) -> Path:
    """A plan on cpu-hetero4 from [(micro_batches, [(devices, (first layer, end layer)), ...]), ...]."""
    plan = load_plan(HETERO_PLAN)
    strategy = Strategy(name, tuple(Pipeline(mb, tuple(Stage(tuple(d), lay) for d, lay in stages))
                                    for mb, stages in pipelines))
    training = _training(plan, global_batch=global_batch, micro_batch=micro_batch, seq_len=seq_len)
    save_plan(replace(plan, model="llama-tiny", cluster="cpu-hetero4", training=training, strategies=(strategy,)),
              dst)
    load_plan_context(dst)  # valid
    return dst


def reference(plan_path: Path, steps: int, data_file: Path | None = None) -> tuple[list[float], ReferenceTrainer]:
    """Losses of ``steps`` steps of the single-process reference, on the launcher's data stream."""
    ctx = load_plan_context(plan_path)
    t = ctx.plan.training
    trainer = ReferenceTrainer(ctx.model, t)
    source: TokenSource = token_source(vocab_size=ctx.model.vocab_size, global_batch=t.global_batch,
                                       seq_len=t.seq_len, seed=t.seed, data_file=data_file)
    return [trainer.train_step(source.batch(step)).loss for step in range(1, steps + 1)], trainer


def reference_state(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments of the reference, named as in a checkpoint."""
    return {**trainer.parameters(), **optimizer_state(trainer)}

"""The single-process reference: the whole model on one device, the training every plan must reproduce.

Same initial weights (name-seeded init), same loss normalisation (token-sum / global token count), same
clipping and AdamW settings as the engine. Tests compare every distributed plan against it, and the
runtime benchmark uses it as the plain PyTorch loop.
"""

from __future__ import annotations

import contextlib
import time

import torch

from runtime.engine.api import StepStats
from runtime.engine.balancing import host_loads
from runtime.engine.optim import build_adamw, clip_coefficient, set_lr
from runtime.models.llama import causal_lm_loss_sum
from runtime.models.moe import MoeForCausalLM, causal_lm
from runtime.torchfree.precision import Precision, uses_bf16
from runtime.torchfree.spec import ModelSpec, TrainingSettings


def autocast_for(device: torch.device, precision: Precision = "auto") -> contextlib.AbstractContextManager[None]:
    """bf16 autocast or nothing (fp32), as ``precision`` says: the engine and the reference share this policy."""
    if uses_bf16(precision, device.type):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def step_casts(device: torch.device, precision: Precision = "auto") -> contextlib.AbstractContextManager[None]:
    """Around a whole step: autocast's bf16 copy of each weight made once and shared by every micro-batch.

    Each micro-batch's forward runs in its own ``autocast_for``, and autocast empties its weight-cast cache
    when the outermost autocast region exits, so without this every in-flight micro-batch saved its own bf16
    copy of every weight for its backward (2 bytes per parameter per micro-batch in flight: more than the
    optimizer state on a deep pipeline's first stage). A disabled autocast region spanning the step keeps
    the cache alive (backward itself runs outside autocast) and the copies are dropped at its end, before
    the optimizer changes the fp32 weights. The copies are bitwise the casts each forward would make."""
    if uses_bf16(precision, device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class ReferenceTrainer:
    """Plain PyTorch training of the full model on one device.

    ``micro_batch``: run the global batch in chunks of this many samples (gradient accumulation), or in
    one forward pass when None. Either way the gradient is that of (sum of token losses) / tokens. A MoE
    model's load-balancing loss and capacity are per forward: a plan's reference uses its micro-batch.
    """

    def __init__(self, model: ModelSpec, training: TrainingSettings, *, device: torch.device | str = "cpu",
                 micro_batch: int | None = None, precision: Precision = "auto") -> None:
        self.spec = model
        self.precision = precision
        self.training = training
        self.device = torch.device(device)
        self.micro_batch = micro_batch
        module = causal_lm(model)
        module.init_weights(training.seed)  # on CPU: the same numbers whatever device runs the step
        self.module = module.to(self.device)
        self.params = [p for p in self.module.parameters()]
        self.optimizer = build_adamw(self.params, training.optimizer)
        self.steps = 0  # updates done: the schedule's index (OptimizerSettings.lr_at)

    def train_step(self, global_batch: torch.Tensor) -> StepStats:
        """One optimizer step on ``global_batch`` [samples, seq_len + 1] (inputs then shifted labels)."""
        t0 = time.perf_counter()
        batch = global_batch.to(self.device)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        chunk = self.micro_batch or batch.shape[0]
        for p in self.params:
            p.grad = None
        loss_sum = torch.zeros((), device=self.device)
        for rows in batch.split(chunk):
            if isinstance(self.module, MoeForCausalLM):  # the load-balancing loss weighted as the chunk's tokens
                self.module.set_aux_scale(rows.shape[0] * (rows.shape[1] - 1) / tokens)
            with autocast_for(self.device, self.precision):
                logits = self.module(rows[:, :-1])
            loss = causal_lm_loss_sum(logits, rows[:, 1:])
            (loss / tokens).backward()
            loss_sum += loss.detach()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        coef = clip_coefficient(norm, self.training.optimizer.grad_clip)
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        lr = self.update()
        loads = None
        if isinstance(self.module, MoeForCausalLM):  # the step's loads (aux-loss-free balancing moves by them)
            loads = host_loads(self.module.update_router_biases())
        loss_value = (loss_sum / tokens).item()
        return StepStats(loss=loss_value, grad_norm=norm.item(), tokens=tokens,
                         compute_s=time.perf_counter() - t0, comm_s=0.0, lr=lr, expert_loads=loads)

    def update(self) -> float:
        """AdamW on the gradients in ``.grad`` at the schedule's rate for this update, which it returns."""
        lr = self.training.optimizer.lr_at(self.steps)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.steps += 1
        return lr

    def router_biases(self) -> dict[str, torch.Tensor]:
        """Every router's ``expert_bias`` (aux-loss-free balancing) by its buffer's name; empty when off."""
        if not isinstance(self.module, MoeForCausalLM) or self.spec.moe is None or self.spec.moe.bias_update_rate == 0:
            return {}
        return {n: r.expert_bias.detach() for n, r in self.module.routers().items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        """Full parameters by name (detached, on the trainer's device)."""
        return {n: p.detach() for n, p in self.module.named_parameters()}

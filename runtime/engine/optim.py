"""AdamW on local shards and global-norm clipping.

AdamW is element-wise, so running it on each device's shard of a parameter gives exactly the slice of
the single-device update, provided the gradient is the full (synced, normalised) one and clipping uses
the global norm. The optimizer sees plain tensors that alias the local shards (DTensor's local tensor
or the plain parameter): the same code for TP 1 and TP > 1, and no DTensor dispatch in the update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.spec import OptimizerSettings


def build_adamw(params: Sequence[torch.Tensor], settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW (decoupled weight decay on every parameter) with the plan's settings."""
    return torch.optim.AdamW(list(params), lr=settings.lr, betas=(settings.beta1, settings.beta2),
                             eps=settings.eps, weight_decay=settings.weight_decay)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by; None when clipping is off."""
    if max_norm <= 0:
        return None
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


class LocalAdamW:
    """AdamW over this device's shards.

    ``shards``: name -> the local tensor of each parameter (aliases the module's storage, so an update
    here is an update of the module). Gradients are handed in at ``step`` time as plain local tensors.
    """

    def __init__(self, shards: dict[str, torch.Tensor], settings: OptimizerSettings) -> None:
        self.names = list(shards)
        # nn.Parameter(t) shares t's storage: stepping these updates the model in place.
        self.params = [torch.nn.Parameter(shards[n].detach(), requires_grad=False) for n in self.names]
        self.settings = settings
        self.optimizer = build_adamw(self.params, settings)

    def step(self, grads: dict[str, torch.Tensor], coef: torch.Tensor | None) -> None:
        gs = [grads[n] for n in self.names]
        if coef is not None:
            torch._foreach_mul_(gs, coef.to(gs[0].device))
        for p, g in zip(self.params, gs):
            p.grad = g
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    @property
    def step_count(self) -> int:
        for p in self.params:
            st = self.optimizer.state.get(p)
            if st and "step" in st:
                return int(st["step"])
        return 0

    def state(self) -> dict[str, torch.Tensor]:
        """``NAME`` (the shard), ``NAME.exp_avg``, ``NAME.exp_avg_sq`` and ``step`` (a 0-d tensor)."""
        out: dict[str, torch.Tensor] = {}
        for n, p in zip(self.names, self.params):
            out[n] = p.detach()
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}.{key}"] = st[key] if key in st else torch.zeros_like(p)
        out["step"] = torch.tensor(float(self.step_count))
        return out

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of ``state``: shards and moments copied in place; ``step`` restores bias correction."""
        missing = [k for n in self.names for k in (n, f"{n}.exp_avg", f"{n}.exp_avg_sq") if k not in state]
        if missing or "step" not in state:
            raise KeyError(f"local state lacks {(missing + ['step'] if 'step' not in state else missing)[:5]}")
        step = float(state["step"])
        for n, p in zip(self.names, self.params):
            src = state[n]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{n}: shard shape {tuple(src.shape)} does not match {tuple(p.shape)}")
            p.copy_(src)
            if step > 0:
                self.optimizer.state[p] = {
                    "step": torch.tensor(step),
                    "exp_avg": state[f"{n}.exp_avg"].to(p.device, p.dtype).clone(),
                    "exp_avg_sq": state[f"{n}.exp_avg_sq"].to(p.device, p.dtype).clone(),
                }
            else:
                self.optimizer.state.pop(p, None)

"""Reference computations only the tests use, each the plain definition a runtime path must match.

Importable by name from any test (pytest puts tests/ on ``sys.path`` for tests/conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from runtime.engine.api import StepStats
from runtime.engine.optim import clip_coefficient
from runtime.engine.reference import ReferenceTrainer, autocast_for
from runtime.models.llama import causal_lm_loss_sum
from runtime.torchfree.annotations import DUPLICATE, PARTIAL, DistributedStates, Layout, LayoutError
from runtime.torchfree.annotations.states import region_index


def local_view(layout: Layout, full: Any, device: int) -> Any:
    """The slice of a global tensor ``full`` that ``device`` holds (non-partial layouts)."""
    if layout.is_partial:
        raise LayoutError("a partial layout has no local view of a single global tensor")
    return full[region_index(layout.region(device))]


def global_view(layout: Layout, locals_: Mapping[int, Any]) -> Any:
    """Rebuild the global tensor from every device's local tensor (partial summands are added)."""
    first = next(iter(locals_.values()))
    out = torch.zeros(layout.shape, dtype=first.dtype, device=first.device)
    covered = torch.zeros(layout.shape, dtype=torch.bool, device=first.device)
    for dev, h in layout.holdings:
        if h.replica != 0 or (h.cls != 0 and layout.is_partial):
            continue
        idx = region_index(h.region)
        if layout.is_partial:
            out[idx] += locals_[dev]
        else:
            out[idx] = locals_[dev]
        covered[idx] = True
    if not bool(covered.all()):
        raise LayoutError("the local tensors do not cover the whole tensor")
    return out


def to_placements(states: DistributedStates) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The bottom tier in DTensor terms: mesh shape and one placement per mesh dim.

    The subgroup's devices, in group order, reshaped row-major to the mesh shape form the DeviceMesh
    (the same enumeration as ``order``): split -> Shard(dim), duplicate -> Replicate, partial ->
    Partial("sum"). DTensor's collectives follow the process group's rank order, so hand it only
    groups whose device order is the rank order (``ProcessGroups.mesh`` checks this).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not states.order:
        return (1,), (Replicate(),)
    placements = tuple(Replicate() if d == DUPLICATE else Partial("sum") if d == PARTIAL else Shard(d)
                       for d in states.order)
    return tuple(states.degree(d) for d in states.order), placements

def train_documents(trainer: ReferenceTrainer, documents: Sequence[Sequence[int]]) -> StepStats:
    """One optimizer step of ``trainer`` on whole documents, each run alone (no packing, no mask: the model's
    own causal attention), the gradient that of (sum of token losses) / (labelled tokens, n - 1 per document):
    what any packing and dispatch of a documents run must reproduce."""
    t0 = time.perf_counter()
    labels = sum(len(d) - 1 for d in documents)
    for p in trainer.params:
        p.grad = None
    loss_sum = torch.zeros((), device=trainer.device)
    for doc in documents:
        if len(doc) < 2:
            continue  # a one-token document has no label
        row = torch.tensor(doc, dtype=torch.long, device=trainer.device).unsqueeze(0)
        with autocast_for(trainer.device, trainer.precision):
            logits = trainer.module(row[:, :-1])
        loss = causal_lm_loss_sum(logits, row[:, 1:])
        (loss / labels).backward()
        loss_sum += loss.detach()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainer.params]
    norm = torch.nn.utils.get_total_norm(grads)
    coef = clip_coefficient(norm, trainer.training.optimizer.grad_clip)
    if coef is not None:
        torch._foreach_mul_(grads, coef)
    for p, g in zip(trainer.params, grads):
        p.grad = g
    lr = trainer.update()
    return StepStats(loss=(loss_sum / labels).item() if labels else 0.0, grad_norm=norm.item(),
                     tokens=sum(len(d) for d in documents), compute_s=time.perf_counter() - t0, comm_s=0.0, lr=lr)


def optimizer_state(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    """``NAME.exp_avg`` / ``NAME.exp_avg_sq`` of ``trainer`` for every parameter that has taken a step."""
    out: dict[str, torch.Tensor] = {}
    for n, p in trainer.module.named_parameters():
        st = trainer.optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                out[f"{n}.{key}"] = st[key]
    return out

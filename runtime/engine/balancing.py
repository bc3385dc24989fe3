"""Every MoE layer's expert loads over the whole step, summed across devices: what a run reports
(``StepStats.expert_loads``) and what DeepSeek-V3's auxiliary-loss-free balancing moves each router's bias by,
the same on every holder.

Each device counts the tokens its routers gave each expert (``Router.load``). Who routed which tokens is
exactly what the router's gradient annotation says (annotations/from_plan.py ``stage_member``): the ranks of
a TP-split stage all route every token of their pipeline (duplicate: counted once), the ranks of an
expert-parallel stage each route a slice (partial: summed), the pipelines route different samples (HDim -2:
summed). So the loads are summed by the gradient sync's own machinery (``GradientSync`` over
``plan_sync``'s buckets, the first-replica rule included), with the routers' gradient annotations at shape
[num_experts]: the same device groups as the routers' gradients, which ``strategy_groups`` creates.

The sum runs beside the gradient sync, before the step commits (elastic training may abandon a step there,
and the next step starts counting afresh); the biases move after the optimizer's update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.comm.groups import ProcessGroups
from runtime.engine.data_parallel import GradientSync
from runtime.models.llama import LlamaForCausalLM
from runtime.models.moe import MoeForCausalLM, Router
from runtime.torchfree.annotations.from_plan import ParamAnnotation
from runtime.torchfree.annotations.states import Annotation
from runtime.torchfree.comm.gradsync import SyncBucket, plan_sync
from runtime.torchfree.models.params import router_bias_names, router_biases
from runtime.torchfree.spec.model import ModelSpec


def load_entries(model: ModelSpec, params: Sequence[ParamAnnotation]) -> list[tuple[str, tuple[int, ...], Annotation]]:
    """``(bias name, [num_experts], its router's gradient annotation)`` for every router of the model, in one
    global order (``GradientSync``'s entries: the same list on every device)."""
    biases = router_bias_names(model)
    if not biases or model.moe is None:
        return []
    grads = {p.name: p.grad for p in params}
    return [(n, (model.moe.num_experts,), grads[info.name]) for n, info in biases.items()]


def load_sync_buckets(entries: Sequence[tuple[str, tuple[int, ...], Annotation]]) -> list[SyncBucket]:
    """The all-reduces that sum the loads (``plan_sync`` of the entries' layouts)."""
    return plan_sync([a.layout(shape) for _, shape, a in entries])


class RouterBalance:
    """One device's part of the loads and of aux-loss-free balancing: ``begin`` at a step's start,
    ``sum_loads`` with the gradient sync, ``update`` after the optimizer's update."""

    def __init__(self, model: ModelSpec, params: Sequence[ParamAnnotation], chunks: Sequence[LlamaForCausalLM],
                 groups: ProcessGroups) -> None:
        entries = load_entries(model, params)
        self.routers: dict[str, Router] = {}
        for m in chunks:
            if isinstance(m, MoeForCausalLM) and entries:
                self.routers.update(m.routers())
        self.sync = GradientSync(entries, load_sync_buckets(entries), groups)
        for b in self.sync.buckets:
            groups.get(b.devices)   # a group the strategy's required groups lack fails here, not mid-step
        self.loads: dict[str, torch.Tensor] = {}
        self.balancing = bool(router_biases(model))

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def begin(self) -> None:
        """Forget what an abandoned step counted."""
        for r in self.routers.values():
            r.take_load()
        self.loads = {}

    def sum_loads(self) -> None:
        """This step's loads, summed over every device that routed a share of the layer's tokens (fp64: exact
        token counts). Collective over the load-sync groups."""
        self.loads = {n: r.take_load().double() for n, r in self.routers.items()}
        self.sync.sync(self.loads)

    @torch.no_grad()
    def update(self) -> None:
        """Move every held router's bias by the step's loads (aux-loss-free balancing; nothing without it)."""
        if self.balancing:
            for n, r in self.routers.items():
                r.update_bias(self.loads[n])
        self.loads = {}

    def biases(self) -> dict[str, torch.Tensor]:
        """The biases held here, by name (the live tensors); none where the model does not balance by them."""
        return {n: r.expert_bias for n, r in self.routers.items()} if self.balancing else {}

    @torch.no_grad()
    def load_biases(self, biases: dict[str, torch.Tensor]) -> None:
        """Set every bias held here from ``biases`` (full tensors by name; each held one must be there, where
        the model balances by them)."""
        if not self.balancing:
            return
        for n, r in self.routers.items():
            r.expert_bias.copy_(biases[n].to(r.expert_bias.dtype))


def host_loads(loads: dict[str, torch.Tensor] | None) -> dict[str, tuple[float, ...]] | None:
    """Loads by router as host numbers (reading them waits for the device: once per step, at its end)."""
    return None if loads is None else {n: tuple(float(x) for x in load.cpu()) for n, load in loads.items()}

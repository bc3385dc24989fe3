"""Engine jobs for a persistent gloo world (runtime.comm.world.LocalWorld): one plan, a few steps.

A world costs seconds to start, a job less: each test module starts one ``LocalWorld`` and runs its
plans as jobs. A job creates the plan's process groups on every rank (idle ranks too: group creation
is collective), trains on the strategy's devices and returns losses, norms and local shards as numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from runtime.comm.world import LocalWorld, WorkerContext, WorkerError

OP_TIMEOUT = timedelta(seconds=60)


@dataclass
class DeviceResult:
    device: int
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, np.ndarray]  # DeviceProgram.local_state()
    regions: dict[str, tuple[tuple[int, int], ...]]  # name -> (start, stop) per dim of the full tensor
    primary: dict[str, bool]
    # ZeRO-1: name -> ((slice region, start, stop), ...) of the 1-D moments (DeviceProgram.moment_pieces())
    moment_pieces: dict[str, tuple[tuple[tuple[tuple[int, int], ...], int, int], ...]]
    moment_numel: int  # DeviceProgram.moment_numel()
    description: dict[str, Any]
    spans: list[tuple[str, str]]  # (kind, name) of every hooks.span of the last step
    compute_s: float  # of the last step
    comm_s: float
    biases: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # DeviceProgram.router_biases()
    expert_loads: list[dict[str, tuple[float, ...]]] = dataclasses.field(default_factory=list)  # per step


class RecordingHooks:
    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def span(self, kind: str, name: str, **args: object) -> Iterator[None]:
        self.spans.append((kind, name))
        yield


def plan_with(plan: str, schedule: str | None = None, zero: bool | None = None, redundancy: int | None = None):
    """The plan's context, with its schedule and ZeRO-1 settings replaced where given."""
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan)
    changes: dict[str, Any] = {}
    if schedule is not None:
        changes["schedule"] = schedule
    if zero is not None:
        changes["zero"] = zero
    if redundancy is not None:
        changes["zero_redundancy"] = redundancy
    if changes:
        training = dataclasses.replace(ctx.plan.training, **changes)
        ctx = dataclasses.replace(ctx, plan=dataclasses.replace(ctx.plan, training=training))
    return ctx


def train_job(w: WorkerContext, plan: str, batches: list[np.ndarray], schedule: str | None,
              zero: bool | None = None, load_dir: str | None = None, save_dir: str | None = None,
              first_step: int = 1, redundancy: int | None = None) -> DeviceResult | None:
    """Train ``batches`` (after loading ``load_dir``; then save to ``save_dir``, steps counted from
    ``first_step``)."""
    from runtime.checkpoint import load_checkpoint, save_checkpoint
    from runtime.engine.api import WorkerContext as EngineContext
    from runtime.engine.program import DeviceProgram
    from runtime.torchfree.spec.handle import StrategyHandle

    ctx = plan_with(plan, schedule, zero, redundancy)
    handle = StrategyHandle.of(ctx)
    strategy = handle.name
    w.groups.ensure(DeviceProgram.required_groups(handle))
    if w.device not in handle.devices:
        return None
    hooks = RecordingHooks()
    program = DeviceProgram(EngineContext(handle, w.device, w.ranks, torch.device("cpu"), OP_TIMEOUT),
                            w.groups, hooks)
    if load_dir is not None:
        assert load_checkpoint(program, load_dir, ctx) == first_step - 1
    stats = []
    for b in batches:
        hooks.spans.clear()
        stats.append(program.train_step(torch.from_numpy(b)))
    if save_dir is not None:
        save_checkpoint(program, w.groups, save_dir, plan=ctx, strategy=strategy,
                        step=first_step - 1 + len(batches))
    ann = program.param_annotations()
    return DeviceResult(
        device=w.device, losses=[s.loss for s in stats], grad_norms=[s.grad_norm for s in stats],
        state={k: v.detach().numpy().copy() for k, v in program.local_state().items()},
        regions={n: tuple((s.start, s.stop) for s in a.region) for n, a in ann.items()},
        primary={n: a.primary for n, a in ann.items()},
        moment_pieces={n: tuple((p.region, p.start, p.stop) for p in ps) for n, ps in program.moment_pieces().items()},
        moment_numel=program.moment_numel(), description=program.describe().to_data(),
        spans=list(hooks.spans), compute_s=stats[-1].compute_s, comm_s=stats[-1].comm_s,
        biases={k: v.detach().numpy().copy() for k, v in program.router_biases().items()},
        expert_loads=[dict(s.expert_loads or {}) for s in stats])


class EngineWorld:
    """A LocalWorld that is replaced after a failed job (its collectives may be left half-done)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.world = LocalWorld(size, timeout_s=OP_TIMEOUT.total_seconds())
        self.world.start()

    def train(self, plan: str, batches: list[torch.Tensor], schedule: str | None = None, *, zero: bool | None = None,
              load_dir: str | None = None, save_dir: str | None = None,
              first_step: int = 1, redundancy: int | None = None) -> dict[int, DeviceResult]:
        if not self.world.alive:
            self.world = LocalWorld(self.size, timeout_s=OP_TIMEOUT.total_seconds())
            self.world.start()
        try:
            out = self.world.run(train_job, plan, [b.numpy() for b in batches], schedule, zero, load_dir, save_dir,
                                 first_step, redundancy, timeout_s=180)
        except WorkerError:
            self.world.close(force=True)
            raise
        return {r.device: r for r in out if r is not None}

    def close(self) -> None:
        self.world.close()


def saved_activation_job(w: WorkerContext, plan: str) -> dict[str, Any] | None:
    """Bytes one micro-batch's forward through the plan's first TP stage saves for backward on this rank,
    split into what its decoder layers' norms save and the rest: with the plan's own
    ``training.sequence_parallel`` and with it off. Counted by saved-tensor hooks (DTensors by their
    local shard)."""
    from runtime.engine.tensor_parallel import apply_tensor_parallel, local_tensor
    from runtime.models.llama import LlamaForCausalLM, RMSNorm
    from runtime.torchfree.models.params import llama_parameters
    from runtime.torchfree.spec import load_plan_context

    ctx = load_plan_context(plan)
    stage = next(s for p in ctx.plan.strategies[0].pipelines for s in p.stages if s.tp > 1)
    w.groups.ensure([stage.devices])
    if w.device not in stage.devices:
        return None
    out = {}
    (lo, hi), = stage.layers
    for sp in (False, True):
        # The stage's layers as a chunk between two others (no embedding, no head): the decoder layers only.
        module = LlamaForCausalLM(ctx.model, range(lo, hi), embed=False, head=False)
        module.init_weights(ctx.plan.training.seed)
        infos = [i for i in llama_parameters(ctx.model) if i.owner == "layer" and lo <= i.layer < hi]
        apply_tensor_parallel(module, infos, w.groups.mesh(stage.devices), sp)
        inside: list[bool] = []

        def enter(*_: object, inside: list[bool] = inside) -> None:
            inside.append(True)

        def leave(*_: object, inside: list[bool] = inside) -> None:
            inside.pop()

        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.register_forward_pre_hook(enter)
                m.register_forward_hook(leave)
        counts = {"norms": 0, "other": 0}

        weights = {id(p) for p in module.parameters()} | {id(local_tensor(p)) for p in module.parameters()}

        def pack(t: torch.Tensor, counts: dict[str, int] = counts, inside: list[bool] = inside,
                 weights: set[int] = weights) -> torch.Tensor:
            local = local_tensor(t)
            if id(t) not in weights and id(local) not in weights:   # activations only
                counts["norms" if inside else "other"] += local.numel() * local.element_size()
            return t

        t = ctx.plan.training
        x = torch.randn(t.micro_batch, t.seq_len, ctx.model.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x.requires_grad_())
        out["on" if sp else "off"] = counts
    return {"device": w.device, "counts": out}


def bf16_weight_copies_job(w: WorkerContext, plan: str, batches: list[np.ndarray], shared: bool = True
                           ) -> tuple[int, list[float], int, int] | None:
    """Train ``batches`` under bf16 autocast, counting the distinct bf16 copies of the stage's 2-D weights that
    autograd saved for backward during the last step: (device, losses, copies, weights). ``shared=False``
    runs without the step-wide cast cache (``step_casts``), as the engine did before it."""
    import runtime.engine.program as program_module

    original = program_module.step_casts
    if not shared:
        program_module.step_casts = lambda device, precision: contextlib.nullcontext()
    try:
        return _count_copies(w, plan, batches, program_module)
    finally:
        program_module.step_casts = original


def _count_copies(w: WorkerContext, plan: str, batches: list[np.ndarray], program_module: Any
                  ) -> tuple[int, list[float], int, int] | None:
    from runtime.engine.api import WorkerContext as EngineContext
    from runtime.torchfree.spec.handle import StrategyHandle

    handle = StrategyHandle.of(plan_with(plan))
    w.groups.ensure(program_module.DeviceProgram.required_groups(handle))
    if w.device not in handle.devices:
        return None
    program = program_module.DeviceProgram(EngineContext(handle, w.device, w.ranks, torch.device("cpu"), OP_TIMEOUT,
                                                         precision="bf16"), w.groups, RecordingHooks())
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    matrices = [local(p).detach() for p in program.params.values() if p.dim() == 2]
    losses: list[float] = []
    copies: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        x = local(t)
        # a weight's cast, not an activation that happens to have a weight's shape
        if x.dtype == torch.bfloat16 and x.dim() == 2 and any(
                torch.equal(y, m.to(torch.bfloat16)) for m in matrices for y in (x, x.mT) if y.shape == m.shape):
            copies.add(x.untyped_storage().data_ptr())
        return t

    for b in batches:
        copies.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses.append(program.train_step(torch.from_numpy(b)).loss)
    return w.device, losses, len(copies), len(matrices)

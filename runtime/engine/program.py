"""The per-device specialized program: build the stage, shard it, run the schedule, sync, step.

One instance per worker. Construction specializes the plain model for this device (one module per model
chunk the stage holds, each with its layers only; DTensor TP inside its stage group, boundary routes per
virtual-stage boundary, gradient-sync buckets across pipelines, AdamW on local shards, or ZeRO-1 over
the pipelines with ``training.zero``: zero.py); ``train_step`` walks the pipeline schedule's action
list for this stage (runtime/torchfree/pipeline_schedules.py), then syncs (the gradients and, under
aux-loss-free balancing, the routers' loads: balancing.py) and steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from runtime.comm.execute import torch_dtype
from runtime.comm.groups import ProcessGroups
from runtime.device_clock import SpanTimes, device_clock
from runtime.engine.api import NULL_HOOKS, Hooks, StepStats, WorkerContext
from runtime.engine.balancing import RouterBalance, host_loads
from runtime.engine.build import build_chunk
from runtime.engine.data_parallel import GradientSync
from runtime.engine.expert_parallel import apply_expert_parallel
from runtime.engine.microbatch import MicroBatch, StepBatch, window_micro_batch
from runtime.engine.optim import LocalAdamW, ShardedAdamW, clip_coefficient
from runtime.engine.pipeline import BoundaryChannel, connect_peers
from runtime.engine.reference import autocast_for, step_casts
from runtime.engine.tensor_parallel import local_tensor
from runtime.models.llama import LlamaForCausalLM, causal_lm_loss_sum
from runtime.models.moe import LoadsKept, MoeForCausalLM
from runtime.torchfree.annotations.from_plan import strategy_groups
from runtime.torchfree.comm.resolve import CommOp
from runtime.torchfree.engine.describe import COMPUTE_NAMES, ProgramDescription, action_name, describe_plan
from runtime.torchfree.engine.specialize import (
    BOUNDARY_DTYPE,
    BoundaryOps,
    DevicePlan,
    ParamShard,
    resolve_boundary,
    specialize,
    stage_actions,
    weight_grad_from_outputs,
)
from runtime.torchfree.engine.zero import MomentPiece
from runtime.torchfree.pipeline_schedules import Action, Compute, Message, PostRecv, PostSend, WaitRecv, WaitSends
from runtime.torchfree.precision import Precision
from runtime.torchfree.spec.handle import StrategyHandle


class DeviceProgram:
    """This device's share of one strategy of a plan, ready to train."""

    def __init__(self, ctx: WorkerContext, groups: ProcessGroups, hooks: Hooks = NULL_HOOKS) -> None:
        plan = specialize(ctx.strategy, ctx.device_id)
        if plan is None:
            raise ValueError(f"device {ctx.device_id} is idle in strategy {ctx.strategy.name!r}: it has no program "
                             "(start workers only for the strategy's devices)")
        if groups.my_device != ctx.device_id:
            raise ValueError(f"ProcessGroups belong to device {groups.my_device}, this worker is {ctx.device_id}")
        self.ctx = ctx
        self.plan: DevicePlan = plan
        self.role = role = plan.role
        self.groups = groups
        self.hooks = hooks
        self.device = ctx.torch_device
        self.boundary_dtype = torch_dtype(BOUNDARY_DTYPE)
        spec = ctx.strategy.model
        t = ctx.strategy.training
        self.tokens = t.global_batch * t.seq_len
        self.ranks = dict(ctx.ranks)
        self.annotations = plan.annotations

        mesh = groups.mesh(role.devices, self.device.type) if role.tp > 1 else None
        # Expert parallelism: this device's experts, and the stage's token exchange (expert_parallel.py).
        experts = role.experts if role.tp > 1 else None
        chunks: list[LlamaForCausalLM] = []
        shards = {s.name: s for s in plan.shards}
        for c in role.chunks:
            # Meta first, then only this rank's shards, with the reference's initial numbers (build.py).
            module = build_chunk(spec, c, shards, seed=t.seed, device=self.device, mesh=mesh,
                                 sequence_parallel=t.sequence_parallel, experts=experts)
            if experts is not None and role.expert_placement is not None:
                pg = groups.get(role.devices)
                apply_expert_parallel(module, role.expert_placement, role.devices, pg, groups.order(pg))
            if isinstance(module, MoeForCausalLM):  # a micro-batch's share of the step's loss, as its tokens'
                module.set_aux_scale(role.micro_batch * t.seq_len / self.tokens)
            if c.recomputed:
                checkpoint_layers(module, c.recomputed)
            chunks.append(module)
        _share_parameters(chunks)
        self._records = [OutputRecord(m, skip=_layers(m, c.recomputed)) if weight_grad_from_outputs(plan, c) else None
                         for c, m in zip(role.chunks, chunks)]
        # Partial recompute under a split backward: B computes the recomputed layers' weight gradients itself
        # (deferring them to W would rerun their forward a second time).
        self._in_input_grad = [[p for layer in _layers(m, c.recomputed) for p in layer.parameters()]
                               if record is not None else []
                               for c, m, record in zip(role.chunks, chunks, self._records)]
        self.chunks = chunks  # [local chunk]: the schedule's Compute.chunk indexes it
        self._chunk_params = [list(m.parameters()) for m in chunks]
        self.shards: tuple[ParamShard, ...] = plan.shards
        held = {n: p for m in reversed(chunks) for n, p in m.named_parameters()}
        self.params = {s.name: held[s.name] for s in self.shards}
        for s in self.shards:
            got = tuple(local_tensor(self.params[s.name]).shape)
            if got != s.local_shape:
                raise AssertionError(f"{s.name}: local shard {got} but the specialization expects {s.local_shape}")
        local = {n: local_tensor(p) for n, p in self.params.items()}
        self.optimizer: LocalAdamW | ShardedAdamW
        if t.zero:
            self.optimizer = ShardedAdamW(
                local, {s.name: tuple((r.start, r.stop) for r in s.region) for s in self.shards}, plan.zero_slices,
                plan.zero_buckets, t.optimizer, groups)
        else:
            self.optimizer = LocalAdamW(local, t.optimizer)
        self.grad_sync = GradientSync([(p.name, p.shape, p.grad) for p in plan.annotations.params], plan.grad_sync,
                                      groups)
        self.balance = RouterBalance(spec, plan.annotations.params, chunks, groups)
        peers = {m.peer for b in plan.routes.values() for op in (b.forward, b.backward)
                 for m in (*op.sends(role.device), *op.recvs(role.device))}
        connect_peers(role.device, peers, self.ranks, self.device)
        devices = ctx.strategy.devices
        self._stats_group = groups.get(devices) if len(devices) > 1 else None
        self._times = SpanTimes(device_clock(self.device))  # device time: host clocks see launches only
        # Packed documents: micro-batch counts and boundary shapes vary by step; both follow from the step's
        # dispatch, which every rank computes identically, so they are derived here rather than sent.
        self._actions: dict[int, tuple[Action, ...]] = {role.micro_batches: plan.actions}
        self._boundaries: dict[tuple[str, tuple[int, ...]], BoundaryOps] = {}

    # -- the launcher-facing API -------------------------------------------------------------------------

    @staticmethod
    def required_groups(strategy: StrategyHandle) -> list[tuple[int, ...]]:
        """Every device group the strategy's programs use (TP groups, gradient sync, statistics)."""
        return strategy_groups(strategy.strategy, strategy.model, strategy.training)

    def train_step(self, global_batch: torch.Tensor | StepBatch, *,
                   before_update: Callable[[StepStats], None] | None = None) -> StepStats:
        """One optimizer step; ``global_batch`` [global_batch, seq_len + 1] is the same on every rank, or
        a ``StepBatch`` of packed documents (runtime/engine/microbatch.py), also the same on every rank.

        ``before_update`` runs after the last communication of the step, before the optimizer changes
        any state, with the step's statistics (final there): elastic training agrees there whether to commit
        the step; if it raises, the step is abandoned and the program's state is exactly as before it. (With
        ZeRO-1 the parameter all-gather follows the update: a failure inside it leaves a committed step
        half-gathered, which elastic recovery repairs from the chunks' copies.)
        """
        t = self.ctx.strategy.training
        role = self.role
        micro_batches, denominator, tokens = self._micro_batches(global_batch)
        self._times.reset()
        for p in self.params.values():
            p.grad = None
        if self.balance.active:
            self.balance.begin()
        run = StepState(self.device, self.ctx.precision)
        run.shapes = {mb: b.shape for mb, b in enumerate(micro_batches)}
        channel = BoundaryChannel(role.device, self.ranks)
        with step_casts(self.device, self.ctx.precision):
            for action in self.actions(len(micro_batches)):
                if isinstance(action, Compute):
                    self._compute(action, micro_batches[action.micro_batch], denominator, run)
                    continue
                with self._span("comm", action_name(action)):
                    if isinstance(action, PostSend):
                        self._post_send(action.message, run, channel)
                    elif isinstance(action, PostRecv):
                        channel.post_recv(action.message, self._route(action.message, run),
                                          dtype=self.boundary_dtype, device=self.device)
                    elif isinstance(action, WaitRecv):
                        self._wait_recv(action.message, run, channel)
                    else:
                        assert isinstance(action, WaitSends)
                        channel.wait_sends()
        grads = self._local_grads()
        if self.plan.grad_sync:
            with self._span("comm", "grad_sync"):
                self.grad_sync.sync(grads)
        loads = None
        if self.balance.active:
            with self._span("comm", "router_loads") if self.balance.sync.buckets else nullcontext():
                self.balance.sum_loads()
            loads = self.balance.loads   # (the step's tensors: read on the host at its end)
        norm_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for s in self.shards:
            if s.primary:
                norm_sq += grads[s.name].float().pow(2).sum()
        loss_sum = run.loss_sum if role.head and role.tp_rank == 0 else torch.zeros((), device=self.device)
        stats = torch.stack([loss_sum.float(), norm_sq])
        if self._stats_group is not None:
            with self._span("comm", "step_stats"):
                dist.all_reduce(stats, group=self._stats_group)
        norm = stats[1].sqrt()
        if before_update is not None:  # (reading the statistics waits for the device: only when asked)
            loss = float(stats[0]) / denominator if denominator else 0.0  # the host waits for the device here
            before_update(StepStats(loss=loss, grad_norm=float(norm), tokens=tokens,
                                    compute_s=self._times.seconds("compute"), comm_s=self._times.seconds("comm"),
                                    lr=t.optimizer.lr_at(self.optimizer.step_count),
                                    expert_loads=host_loads(loads)))
        zero = self.optimizer if isinstance(self.optimizer, ShardedAdamW) else None
        with self._span("compute", "optimizer"):
            if zero is None:
                lr = self.optimizer.step(grads, clip_coefficient(norm, t.optimizer.grad_clip))
            else:
                lr = zero.update(grads, clip_coefficient(norm, t.optimizer.grad_clip))
        if self.balance.active:
            self.balance.update()
        if zero is not None and zero.buckets:
            with self._span("comm", "param_all_gather"):
                zero.gather()
        for p in self.params.values():
            p.grad = None
        loss = float(stats[0]) / denominator if denominator else 0.0
        return StepStats(loss=loss, grad_norm=float(norm), tokens=tokens,
                         compute_s=self._times.seconds("compute"), comm_s=self._times.seconds("comm"), lr=lr,
                         expert_loads=host_loads(loads))

    def _micro_batches(self, batch: torch.Tensor | StepBatch) -> tuple[tuple[MicroBatch, ...], int, int]:
        """This pipeline's micro-batches of the step (on this device), the loss denominator, the step's tokens."""
        role = self.role
        if isinstance(batch, StepBatch):
            if len(batch.pipelines) != len(self.ctx.strategy.strategy.pipelines):
                raise ValueError(f"the step batch has {len(batch.pipelines)} pipelines, strategy "
                                 f"{self.ctx.strategy.name!r} {len(self.ctx.strategy.strategy.pipelines)}")
            mine = tuple(b.to(self.device) for b in batch.pipelines[role.pipeline])
            return mine, batch.num_labels, batch.num_tokens
        t = self.ctx.strategy.training
        if tuple(batch.shape) != (t.global_batch, t.seq_len + 1):
            raise ValueError(f"global batch has shape {tuple(batch.shape)}, the plan needs "
                             f"[{t.global_batch}, {t.seq_len + 1}]")
        rows = batch[role.first_sample:role.first_sample + role.samples].to(self.device)
        n = role.micro_batch
        mine = tuple(window_micro_batch(rows[mb * n:(mb + 1) * n]) for mb in range(role.micro_batches))
        return mine, self.tokens, self.tokens

    def actions(self, micro_batches: int) -> tuple[Action, ...]:
        """This stage's schedule for a step of ``micro_batches`` (none: the pipeline got no document)."""
        if micro_batches not in self._actions:
            self._actions[micro_batches] = stage_actions(self.plan, micro_batches)
        return self._actions[micro_batches]

    def local_state(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """This device's shards: ``NAME``, ``NAME.exp_avg``, ``NAME.exp_avg_sq`` and ``step``.

        The moments share the parameter's layout, except for the parameters in ``moment_pieces()``
        (ZeRO-1): theirs are 1-D, this device's pieces concatenated in that order. ``names``: those
        parameters' alone (without ZeRO-1)."""
        return self.optimizer.state() if names is None else self._local_optimizer().state(names)

    def router_biases(self) -> dict[str, torch.Tensor]:
        """Aux-loss-free balancing's state held here: each held router's bias by name
        (``params.router_biases``; the same on every holder of the router). Empty when balancing is off."""
        return self.balance.biases()

    def load_router_biases(self, biases: dict[str, torch.Tensor]) -> None:
        """Set the held routers' biases from full tensors by name (each held one must be given)."""
        self.balance.load_biases(biases)

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set parameters and AdamW states from a dict shaped like ``local_state()`` (same layouts); a released
        state is allocated again."""
        self.optimizer.load_state(state)

    def release_state(self, names: Sequence[str] | None = None) -> None:
        """Free these parameters' shards and moments (every one: None) while the program stays built: a
        documents run keeps only its current strategy's state (runtime/torchfree/elastic/staging.py)."""
        self._local_optimizer().release(names)

    def receive_state(self, names: Sequence[str], step: int) -> dict[str, torch.Tensor]:
        """Allocate these parameters' shards and moments again, for a switch to write into (``local_state``
        names; the moments are kept only when ``step`` > 0, as AdamW keeps none before its first step)."""
        return self._local_optimizer().receive(names, step)

    def _local_optimizer(self) -> LocalAdamW:
        if not isinstance(self.optimizer, LocalAdamW):
            raise ValueError("a ZeRO-1 program's state is switched whole (runtime/elastic/move.py), not in stages")
        return self.optimizer

    def param_annotations(self) -> dict[str, ParamShard]:
        """Layout of every parameter held here (its AdamW states share it unless ``moment_pieces()``
        lists it): the HSPMD annotation over the strategy, the region of the full tensor this device
        holds, and whether it is the copy counted once (pipeline 0, first TP replica).
        ``self.annotations`` has every parameter's."""
        return {s.name: s for s in self.shards}

    def moment_pieces(self) -> dict[str, tuple[MomentPiece, ...]]:
        """ZeRO-1: the parameters whose AdamW moments this device keeps only in part, and which part:
        elements [start, stop) of the row-major flattening of each listed slice of the full tensor
        (``zero.moment_pieces`` of ``zero.zero_slices``; empty without ZeRO-1 or with one pipeline)."""
        return dict(self.optimizer.pieces) if isinstance(self.optimizer, ShardedAdamW) else {}

    def moment_numel(self) -> int:
        """Elements of each AdamW moment this device keeps (its optimizer-state memory / 8 bytes)."""
        if isinstance(self.optimizer, ShardedAdamW):
            return self.optimizer.moment_numel()
        return sum(local_tensor(p).numel() for p in self.params.values())

    def describe(self) -> ProgramDescription:
        return describe_plan(self.plan)

    # -- the schedule's actions --------------------------------------------------------------------------

    def _compute(self, op: Compute, batch: MicroBatch, denominator: int, run: StepState) -> None:
        """One op of the schedule on one chunk; a tensor for a chunk of this same device (the bottom of
        the V, or a one-stage pipeline) is handed over in memory instead of sent."""
        c = self.role.chunks[op.chunk]
        key = (op.micro_batch, op.chunk)
        layout = self.plan.layout
        args = {"micro_batch": op.micro_batch, "chunk": op.chunk, "layers": c.layers[1] - c.layers[0],
                "first": c.embed, "last": c.head, "strategy": self.ctx.strategy.name}
        if batch.documents:  # packed: the lengths that price the block (sleep mode, traces)
            args["documents"] = batch.documents
        with self._span("compute", COMPUTE_NAMES[op.kind], **args):
            if op.kind == "F":
                record = self._records[op.chunk]
                with record.recording() if record is not None else nullcontext() as outputs:
                    stage_forward(self.chunks[op.chunk], c.embed, c.head, denominator, batch, key, run)
                if outputs is not None:
                    run.recorded[key] = outputs
            elif op.kind == "BW":
                stage_backward(c.embed, c.head, key, run)
            elif op.kind == "B":
                stage_input_grad(c.embed, c.head, key, run, self._chunk_params[op.chunk], self._in_input_grad[op.chunk])
            else:
                stage_weight_grad(key, run)
        j = op.stage
        if op.kind == "F" and not c.head and layout.device(j + 1) == layout.device(j):
            run.inputs[op.micro_batch, layout.chunk(j + 1)] = run.sent.pop(key)
        if op.kind in ("B", "BW") and not c.embed and layout.device(j - 1) == layout.device(j):
            run.grads_in[op.micro_batch, layout.chunk(j - 1)] = run.grads_out.pop(key)

    def _post_send(self, msg: Message, run: StepState, channel: BoundaryChannel) -> None:
        key = (msg.micro_batch, self.plan.layout.chunk(msg.src_stage))
        x = run.sent.pop(key) if msg.kind == "activation" else run.grads_out.pop(key).to(self.boundary_dtype)
        channel.post_send(self._route(msg, run), x)

    def _wait_recv(self, msg: Message, run: StepState, channel: BoundaryChannel) -> None:
        key = (msg.micro_batch, self.plan.layout.chunk(msg.dst_stage))
        x = channel.wait_recv(msg)
        (run.inputs if msg.kind == "activation" else run.grads_in)[key] = x

    def _route(self, msg: Message, run: StepState) -> CommOp:
        """The boundary op ``msg`` runs for its micro-batch's shape: the plan's own for the plan's fixed
        shape, otherwise (packed documents) resolved once per shape."""
        ops = self.plan.routes[msg.src_stage if msg.kind == "activation" else msg.dst_stage]
        shape = (*run.shapes[msg.micro_batch], ops.shape[-1])
        if shape != tuple(ops.shape):
            key = (ops.boundary.stage, shape)
            if key not in self._boundaries:
                self._boundaries[key] = resolve_boundary(dataclasses.replace(ops.boundary, shape=shape),
                                                         self.ctx.strategy.cluster)
            ops = self._boundaries[key]
        return ops.forward if msg.kind == "activation" else ops.backward

    def _local_grads(self) -> dict[str, torch.Tensor]:
        """Plain local gradient tensors, in each parameter's own layout."""
        out = {}
        for name, p in self.params.items():
            g = p.grad
            if g is None:
                g = torch.zeros_like(local_tensor(p))
            elif isinstance(g, DTensor):
                if isinstance(p, DTensor) and g.placements != p.placements:
                    # e.g. the vocab-parallel embedding's gradient comes back replicated: keep our slice.
                    g = g.redistribute(p.device_mesh, p.placements)
                g = g.to_local()
            out[name] = g
        return out

    @contextmanager
    def _span(self, kind: str, name: str, **args: object) -> Iterator[None]:
        with self._times.span(kind), self.hooks.span(kind, name, **args):
            yield


class StepState:
    """Activations and gradients in flight during one step, keyed by micro-batch (and chunk: the engine
    keys them ``(micro_batch, chunk)``)."""

    def __init__(self, device: torch.device, precision: Precision = "auto") -> None:
        self.device = device
        self.precision = precision  # the autocast policy of its compute (runtime/torchfree/precision.py)
        self.inputs: dict[Hashable, torch.Tensor] = {}
        self.outputs: dict[Hashable, torch.Tensor] = {}
        self.sent: dict[Hashable, torch.Tensor] = {}
        self.grads_in: dict[Hashable, torch.Tensor] = {}
        self.grads_out: dict[Hashable, torch.Tensor] = {}
        # B done, W to run: (tensor, its gradient, the parameters to differentiate) per backward W runs
        self.deferred: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]]] = {}
        self.recorded: dict[Hashable, list[tuple[list[torch.Tensor], torch.Tensor]]] = {}  # OutputRecord's
        self.loss_sum: torch.Tensor = torch.zeros((), device=device)
        self.shapes: dict[int, tuple[int, int]] = {}  # (rows, seq) of each micro-batch: its boundary shapes


def stage_forward(module: LlamaForCausalLM, embed: bool, head: bool, tokens: int, batch: MicroBatch, mb: Hashable,
                  run: StepState) -> None:
    """Micro-batch ``mb`` forward through a stage's chunk (``batch``: its tokens, labels and, packed, positions
    and document ids): token ids in on the first chunk, the received boundary tensor elsewhere; out of the
    last chunk the summed loss scaled by the step's ``tokens`` (labelled tokens), elsewhere the output and
    its fp32 copy to send. A function of its own so that ``hspmd profile`` times exactly this."""
    x = batch.tokens if embed else run.inputs[mb].requires_grad_()
    with autocast_for(run.device, run.precision):
        out = module(x, batch.positions, batch.segments)
    if head:
        loss = causal_lm_loss_sum(out, batch.labels)
        run.loss_sum = run.loss_sum + loss.detach()
        run.outputs[mb] = loss / tokens
    else:
        run.outputs[mb] = out
        run.sent[mb] = out.detach().to(torch_dtype(BOUNDARY_DTYPE))


def stage_backward(embed: bool, head: bool, mb: Hashable, run: StepState) -> None:
    """Micro-batch ``mb`` backward: from the scaled loss on the last chunk, else from the received output
    gradient; the input gradient taken out to send (not on the first chunk)."""
    out = run.outputs.pop(mb)
    if head:
        out.backward()
    else:
        out.backward(run.grads_in.pop(mb).to(out.dtype))
    if not embed:
        x = run.inputs.pop(mb)
        run.grads_out[mb] = x.grad
        x.grad = None


def stage_input_grad(embed: bool, head: bool, mb: Hashable, run: StepState,
                     params: list[torch.Tensor] | None = None, with_weights: Sequence[torch.Tensor] = ()) -> None:
    """B of a split backward: the gradient of the chunk's input (what the previous virtual stage waits
    for), by autograd, which evaluates only what that gradient needs (no weight-gradient products).
    Where F recorded the outputs of the chunk's parameter-owning modules (``run.recorded``), their
    gradients come out of the same pass and W only multiplies them into weight gradients; else W is one
    backward to ``params`` through the kept graph. The first chunk has no input gradient: its B is
    empty and its W the whole backward. ``with_weights``: parameters whose gradients B accumulates itself
    (partial recompute's recomputed layers, which F recorded nothing in)."""
    out = run.outputs.pop(mb)
    grad = None if head else run.grads_in.pop(mb).to(out.dtype)
    recorded = run.recorded.pop(mb, None)
    if embed:
        run.deferred[mb] = [(out, grad, list(params or ()))]
    elif recorded is None:
        (run.grads_out[mb],) = torch.autograd.grad(out, run.inputs[mb], grad, retain_graph=True)
        run.deferred[mb] = [(out, grad, list(params or ()))]
    else:
        ys = [y for _, y in recorded]
        gx, *gs = torch.autograd.grad(out, [run.inputs[mb], *ys, *with_weights], grad, retain_graph=True,
                                      allow_unused=True)
        gys, gws = gs[:len(ys)], gs[len(ys):]
        run.grads_out[mb] = gx
        for p, g in zip(with_weights, gws):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        run.deferred[mb] = [(y, g, ps) for (ps, y), g in zip(recorded, gys) if g is not None]


def stage_weight_grad(mb: Hashable, run: StepState) -> None:
    """W of a split backward: the weight gradients (accumulated into ``.grad``) of what B deferred, by
    autograd. Each recorded module output reaches its own parameters in one step (nothing else lies on
    that path: a tied head's weight has no lookup in a chunk that does not embed)."""
    for y, g, params in run.deferred.pop(mb):
        torch.autograd.backward(y, g, inputs=params)
    run.inputs.pop(mb, None)


class OutputRecord:
    """Records, while F runs, the output of each module of a chunk that owns parameters directly (the
    linear projections, the norms, the head), with those parameters: their gradients are what W needs."""

    def __init__(self, module: torch.nn.Module, skip: Sequence[torch.nn.Module] = ()) -> None:
        """``skip``: submodules recorded nothing in (checkpointed layers: their weight gradients are B's)."""
        self._into: list[tuple[list[torch.Tensor], torch.Tensor]] | None = None
        skipped = {id(m) for s in skip for m in s.modules()}
        for m in module.modules():
            own = list(m.parameters(recurse=False))
            if own and id(m) not in skipped:
                m.register_forward_hook(self._hook(own))

    def _hook(self, own: list[torch.Tensor]) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
            if self._into is not None and output.requires_grad:
                self._into.append((own, output))
        return hook

    @contextmanager
    def recording(self) -> Iterator[list[tuple[list[torch.Tensor], torch.Tensor]]]:
        self._into = out = []
        try:
            yield out
        finally:
            self._into = None


def _share_parameters(chunks: list[LlamaForCausalLM]) -> None:
    """A parameter two chunks of one device hold (a tied embedding under ZB-V: the lookup in the first
    chunk, the head in the last) is one tensor, as in the single model: one gradient, one update."""
    seen: dict[str, torch.nn.Parameter] = {}
    for m in chunks:
        for name, p in list(m.named_parameters()):
            if name not in seen:
                seen[name] = p
                continue
            attr = name.rsplit(".", 1)[1]
            for sub in m.modules():  # the owner and, for a tied head, the head sharing it
                if getattr(sub, attr, None) is p:
                    setattr(sub, attr, seen[name])


def _layers(module: LlamaForCausalLM, ids: Sequence[int]) -> list[torch.nn.Module]:
    """The decoder layers ``ids`` of a chunk's module."""
    return [module.model.layers[str(i)] for i in ids]


def checkpoint_layers(module: LlamaForCausalLM, ids: Sequence[int] | None = None) -> None:
    """Recompute: each decoder layer ``ids`` (None: every one) keeps only its input and reruns its forward
    in backward."""
    from torch.utils.checkpoint import checkpoint

    for layer in module.model.layers.values() if ids is None else _layers(module, ids):
        inner = layer.forward

        def _context(_layer=layer):  # the rerun in the backward counts no router load a second time
            return nullcontext(), LoadsKept(_layer)

        def forward(x, cos, sin, attend=None, _inner=inner, _context=_context):
            return checkpoint(_inner, x, cos, sin, attend, use_reentrant=False, context_fn=_context)

        layer.forward = forward

"""What one device's program is, in words: layers, shard shapes and comm ops in execution order.

Pure (no torch): ``hspmd show --device N PLAN`` prints it without starting a world, and
``DeviceProgram.describe()`` returns the same record for the program it runs; both read the device's
``DevicePlan`` (specialize.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.torchfree.comm.resolve import CommOp
from runtime.torchfree.engine.specialize import (
    BOUNDARY_DTYPE,
    ChunkRole,
    DevicePlan,
    ParamShard,
    StageRole,
    specialize,
    weight_grad_from_outputs,
)
from runtime.torchfree.pipeline_schedules import Action, Compute, Message, PostRecv, PostSend, WaitSends
from runtime.torchfree.spec.handle import StrategyHandle


@dataclass(frozen=True)
class OpLine:
    """One step of the program: ``kind`` is "compute" or "comm"; ``action``: the schedule action it runs (None:
    the step's own ops after the schedule), for readers that group the lines by what they do."""

    kind: str
    name: str
    detail: str
    action: Action | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ProgramDescription:
    strategy: str
    device: int
    schedule: str
    role: StageRole | None  # None: the strategy leaves this device idle
    params: tuple[ParamShard, ...]
    ops: tuple[OpLine, ...]
    # Which op order the schedule runs: the list scheduler's or a published one, whichever was faster on the
    # plan's op costs (``runtime.torchfree.schedule_types.Schedule.origin``); "" for an idle device.
    order: str = ""
    order_by: str = ""   # the durations the order was chosen by (docs/schedules.md, "Costs in the plan")

    @property
    def holds(self) -> str:
        if self.role is None:
            return "idle"
        r = self.role
        parts = ["embedding"] if r.embed else []
        parts.append("layers " + ", ".join(f"{a}-{b - 1}" for a, b in r.layers))
        if r.experts is not None:
            parts.append(f"experts {', '.join(map(str, r.experts))} of its MoE layers (expert parallel)")
        if r.head:
            parts.append("final norm + head + loss")
        return ", ".join(parts)

    def to_data(self) -> dict[str, Any]:
        r = self.role
        return {
            "strategy": self.strategy, "device": self.device, "schedule": self.schedule, "order": self.order,
            "order_by": self.order_by,
            "role": None if r is None else {
                "pipeline": r.pipeline, "stage": r.stage, "num_stages": r.num_stages, "tp_rank": r.tp_rank,
                "tp_group": list(r.devices),
                "layers": list(r.layers[0]) if len(r.layers) == 1 else [list(x) for x in r.layers],
                "chunks": [{"chunk": c.chunk, "virtual_stage": c.stage, "layers": list(c.layers), "embed": c.embed,
                            "head": c.head, "recomputed": list(c.recomputed)} for c in r.chunks],
                "embed": r.embed, "head": r.head, "experts": None if r.experts is None else list(r.experts),
                "recompute": r.recompute, "micro_batches": r.micro_batches, "micro_batch": r.micro_batch,
                "samples": [r.first_sample, r.first_sample + r.samples]},
            "holds": self.holds,
            "params": [{"name": p.name, "shape": list(p.info.shape), "local_shape": list(p.local_shape),
                        "tp_dim": p.info.tp_dim if p.tp_size > 1 else None, "primary": p.primary}
                       for p in self.params],
            "ops": [{"kind": o.kind, "name": o.name, "detail": o.detail} for o in self.ops],
        }


COMPUTE_NAMES = {"F": "forward", "BW": "backward", "B": "input_grad", "W": "weight_grad"}
_DIRECTIONS = {("activation", True): "send_forward", ("activation", False): "recv_forward",
               ("gradient", True): "send_backward", ("gradient", False): "recv_backward"}


def action_name(action: Action, chunks: int = 1) -> str:
    """The name of one schedule action, as ``describe`` lists it and the executor's hooks span it."""
    if isinstance(action, Compute):
        return f"{COMPUTE_NAMES[action.kind]} mb{action.micro_batch}" + (
            f" chunk {action.chunk}" if chunks > 1 else "")
    if isinstance(action, WaitSends):
        return "wait sends"
    m = action.message
    verb = "post" if isinstance(action, (PostSend, PostRecv)) else "wait"
    return f"{verb} {_DIRECTIONS[m.kind, isinstance(action, PostSend)]} mb{m.micro_batch} " \
           f"stage {m.src_stage}->{m.dst_stage}"


def _tp_collectives(role: StageRole, chunk: ChunkRole, kind: str, sequence_parallel: bool = False) -> str:
    """The TP collectives DTensor issues inside one op of a chunk (W reruns the input-gradient chain); under
    sequence parallelism each layer's all-reduces are all-gathers and reduce-scatters, and the chunk's
    residual stream is scattered at its first layer and gathered after its last
    (runtime/engine/tensor_parallel.py)."""
    if role.tp == 1 or kind == "B" and chunk.embed:
        return ""
    n = chunk.layers[1] - chunk.layers[0]
    g = ",".join(str(d) for d in role.devices)
    if kind == "F":
        parts = []
        if chunk.embed:
            parts.append("embedding all-reduce")
        if sequence_parallel:
            parts.append(f"sequence scatter, {2 * n} all-gather (attention and MLP inputs) + {2 * n} reduce-scatter "
                         f"(attention and MLP outputs) x {n} layers, output all-gather")
        else:
            parts.append(f"{2 * n} all-reduce (attention and MLP outputs x {n} layers)")
        if chunk.head:
            parts.append("logits all-gather")
    else:
        if sequence_parallel:
            parts = [f"{2 * n} all-gather + {2 * n} reduce-scatter (x {n} layers), input-grad all-gather"]
        else:
            parts = [f"{2 * n} all-reduce (attention and MLP input grads x {n} layers)"]
        if chunk.head:
            parts.append("head input-grad all-reduce")
    return f"TP group [{g}]: " + ", ".join(parts)


def _holds(chunk: ChunkRole) -> str:
    return ("embedding + " if chunk.embed else "") + f"layers {chunk.layers[0]}-{chunk.layers[1] - 1}" + (
        " + head + loss" if chunk.head else "")


def describe_program(handle: StrategyHandle, device: int) -> ProgramDescription:
    plan = specialize(handle, device)
    if plan is None:
        where = handle.strategy.locate(device)
        name = handle.schedule_name(where[0]) if where is not None else handle.training.schedule
        return ProgramDescription(handle.name, device, name, None, (), ())
    return describe_plan(plan)


def describe_plan(plan: DevicePlan) -> ProgramDescription:
    t = plan.handle.training
    role, device = plan.role, plan.device
    shape = (t.micro_batch, t.seq_len, plan.handle.model.hidden_size)
    v = len(role.chunks)
    ops: list[OpLine] = []
    for a in plan.actions:
        name = action_name(a, v)
        if isinstance(a, Compute):
            c = role.chunks[a.chunk]
            recompute = "" if not c.recomputed else " (recompute)" if c.recomputes_all else \
                f" (recompute layers {c.recomputed[0]}-{c.recomputed[-1]})"
            partial = c.recomputed and weight_grad_from_outputs(plan, c)
            in_b = ", and the recomputed layers' weight gradients" if partial else ""
            detail = {"F": _holds(c) + recompute, "BW": ("recompute + " if c.recomputed else "") + "grads",
                      "B": f"input gradient (autograd.grad){in_b}, graph kept" if not c.embed else
                           "nothing (the first chunk has no input gradient); graph kept",
                      "W": "weight gradients from the module-output gradients B kept"
                           if weight_grad_from_outputs(plan, c) else
                           "weight gradients: one backward through the kept graph"}[a.kind]
            # W from the kept module-output gradients is local; a W through the kept graph reruns the chain.
            tp = "" if a.kind == "W" and weight_grad_from_outputs(plan, c) else \
                _tp_collectives(role, c, a.kind, t.sequence_parallel)
            ops.append(OpLine("compute", name, f"virtual stage {a.stage}: {detail}" + (f"; {tp}" if tp else ""), a))
        elif isinstance(a, WaitSends):
            ops.append(OpLine("comm", name, "block until every send posted has completed", a))
        else:
            op = route(plan, a.message)
            what = "isend" if isinstance(a, PostSend) else "irecv" if isinstance(a, PostRecv) else "wait for"
            ops.append(OpLine("comm", name, f"{what} [{'x'.join(map(str, shape))}] {BOUNDARY_DTYPE.name} "
                                            f"({op.kind}): {_messages(op, device, isinstance(a, PostSend))}", a))
    names = [p.name for p in plan.annotations.params]
    for b in plan.grad_sync:
        tensors = sorted({names[i] for i, _ in b.entries})
        ops.append(OpLine("comm", f"grad all-reduce [{','.join(map(str, b.devices))}]",
                          f"SplitAllReduce bucket: {b.numel} elements, {len(b.entries)} slices of {len(tensors)} "
                          f"gradients ({_short(tensors)})"))
    devices = plan.handle.devices
    if len(devices) > 1:
        ops.append(OpLine("comm", "step statistics", f"all-reduce [loss sum, grad norm^2] over {len(devices)} "
                                                     "devices"))
    adam = f"AdamW on {len(plan.shards)} local shards"
    if t.zero:
        pieces = plan.moment_pieces
        kept = sum(p.numel for ps in pieces.values() for p in ps)
        held = sum(math.prod(s.local_shape) for s in plan.shards if s.name in pieces)
        copies = f" (x{t.zero_redundancy} copies)" if t.zero_redundancy > 1 else ""
        adam += (f"; ZeRO-1{copies}: {len(pieces)} of them sharded, moments kept for {kept} of their {held} elements"
                 if pieces else "; ZeRO-1: no data-parallel replicas, nothing sharded")
    ops.append(OpLine("compute", "optimizer", f"clip to global norm {t.optimizer.grad_clip}, {adam}"))
    for z in plan.zero_buckets:
        if device in z.devices:
            ops.append(OpLine("comm", f"param all-gather [{','.join(map(str, z.devices))}]",
                              f"ZeRO-1 bucket: {z.numel} elements in {len(z.slices)} slices of "
                              f"{len({s.name for s in z.slices})} parameters; this device updated "
                              f"{z.length(device)}, sends {z.sent(device)}, parts padded to {z.width}"))
    order = plan.handle.pipeline_schedule(role.pipeline).origin
    costed = all(st.op_costs is not None for st in plan.handle.strategy.pipelines[role.pipeline].stages)
    by = "the plan's op costs" if costed else "layer counts: the plan gives no op costs"
    return ProgramDescription(plan.handle.name, device, plan.schedule, role, plan.shards, tuple(ops), order, by)


def _short(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... (+{len(names) - n})" if len(names) > n else "")


def route(plan: DevicePlan, msg: Message) -> CommOp:
    """The boundary op a message runs: the activation of boundary j (stage j -> j + 1) or its gradient."""
    if msg.kind == "activation":
        return plan.routes[msg.src_stage].forward
    return plan.routes[msg.dst_stage].backward


def _messages(op: CommOp, device: int, send: bool) -> str:
    if send:
        parts = [f"send {m.nbytes} B to {m.peer}" for m in op.sends(device)]
    else:
        parts = [f"recv {m.nbytes} B from {m.peer}" for m in op.recvs(device)]
    return ", ".join(parts) or "nothing for this device"

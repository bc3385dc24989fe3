"""What one device's program is, in words: layers, shard shapes and comm ops in execution order.

Pure (no torch): ``hspmd show --device N PLAN`` prints it without starting a world, and
``DeviceProgram.describe()`` returns the same record for the program it runs; both read the device's
``DevicePlan`` (specialize.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.comm.resolve import CommOp
from runtime.engine.schedules import Comm, Compute
from runtime.engine.specialize import BOUNDARY_DTYPE, DevicePlan, ParamShard, StageRole, specialize
from runtime.spec.handle import StrategyHandle


@dataclass(frozen=True)
class OpLine:
    """One step of the program: ``kind`` is "compute" or "comm"."""

    kind: str
    name: str
    detail: str


@dataclass(frozen=True)
class ProgramDescription:
    strategy: str
    device: int
    schedule: str
    role: StageRole | None  # None: the strategy leaves this device idle
    params: tuple[ParamShard, ...]
    ops: tuple[OpLine, ...]

    @property
    def holds(self) -> str:
        if self.role is None:
            return "idle"
        r = self.role
        parts = ["embedding"] if r.embed else []
        parts.append(f"layers {r.layers[0]}-{r.layers[1] - 1}")
        if r.head:
            parts.append("final norm + head + loss")
        return ", ".join(parts)

    def to_data(self) -> dict[str, Any]:
        r = self.role
        return {
            "strategy": self.strategy, "device": self.device, "schedule": self.schedule,
            "role": None if r is None else {
                "pipeline": r.pipeline, "stage": r.stage, "num_stages": r.num_stages, "tp_rank": r.tp_rank,
                "tp_group": list(r.devices), "layers": list(r.layers), "embed": r.embed, "head": r.head,
                "recompute": r.recompute, "micro_batches": r.micro_batches, "micro_batch": r.micro_batch,
                "samples": [r.first_sample, r.first_sample + r.samples]},
            "holds": self.holds,
            "params": [{"name": p.name, "shape": list(p.info.shape), "local_shape": list(p.local_shape),
                        "tp_dim": p.info.tp_dim if p.tp_size > 1 else None, "primary": p.primary}
                       for p in self.params],
            "ops": [{"kind": o.kind, "name": o.name, "detail": o.detail} for o in self.ops],
        }


def _tp_collectives(role: StageRole, direction: str) -> str:
    """The TP collectives DTensor issues inside one forward or backward block of the stage."""
    if role.tp == 1:
        return ""
    n = role.layers[1] - role.layers[0]
    g = ",".join(str(d) for d in role.devices)
    if direction == "forward":
        parts = []
        if role.embed:
            parts.append("embedding all-reduce")
        parts.append(f"{2 * n} all-reduce (o_proj, down_proj x {n} layers)")
        if role.head:
            parts.append("logits all-gather")
    else:
        parts = [f"{2 * n} all-reduce (attention and MLP input grads x {n} layers)"]
        if role.head:
            parts.append("head input-grad all-reduce")
    return f"TP group [{g}]: " + ", ".join(parts)


def describe_program(handle: StrategyHandle, device: int) -> ProgramDescription:
    plan = specialize(handle, device)
    if plan is None:
        return ProgramDescription(handle.name, device, handle.training.schedule, None, (), ())
    return describe_plan(plan)


def describe_plan(plan: DevicePlan) -> ProgramDescription:
    t = plan.handle.training
    role, device = plan.role, plan.device
    shape = (t.micro_batch, t.seq_len, plan.handle.model.hidden_size)
    what = ("embedding + " if role.embed else "") + f"layers {role.layers[0]}-{role.layers[1] - 1}" + (
        " + head + loss" if role.head else "") + (" (recompute)" if role.recompute else "")
    ops: list[OpLine] = []
    for a in plan.actions:
        if isinstance(a, Compute):
            detail = what if a.kind == "forward" else ("recompute + " if role.recompute else "") + "grads"
            tp = _tp_collectives(role, a.kind)
            ops.append(OpLine("compute", f"{a.kind} mb{a.micro_batch}", detail + (f"; {tp}" if tp else "")))
            continue
        assert isinstance(a, Comm)
        names, details = [], []
        for tr in a.transfers:
            b = plan.prev if tr.kind in ("recv_forward", "send_backward") else plan.next
            assert b is not None
            op = b.forward if tr.kind.endswith("forward") else b.backward
            names.append(f"{tr.kind} mb{tr.micro_batch}")
            details.append(f"{tr.kind} ({op.kind}): {_messages(op, device)}")
        ops.append(OpLine("comm", " + ".join(names), f"one batch_isend_irecv of [{'x'.join(map(str, shape))}] "
                                                     f"{BOUNDARY_DTYPE.name}: " + "; ".join(details)))
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
        adam += (f"; ZeRO-1: {len(pieces)} of them sharded, moments kept for {kept} of their {held} elements"
                 if pieces else "; ZeRO-1: no data-parallel replicas, nothing sharded")
    ops.append(OpLine("compute", "optimizer", f"clip to global norm {t.optimizer.grad_clip}, {adam}"))
    for z in plan.zero_buckets:
        if device in z.devices:
            ops.append(OpLine("comm", f"param all-gather [{','.join(map(str, z.devices))}]",
                              f"ZeRO-1 bucket: {z.numel} elements in {len(z.slices)} slices of "
                              f"{len({s.name for s in z.slices})} parameters; this device updated "
                              f"{z.length(device)}, parts padded to {z.width}"))
    return ProgramDescription(plan.handle.name, device, plan.schedule, role, plan.shards, tuple(ops))


def _short(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... (+{len(names) - n})" if len(names) > n else "")


def _messages(op: CommOp, device: int) -> str:
    parts = [f"send {m.nbytes} B to {m.peer}" for m in op.sends(device)]
    parts += [f"recv {m.nbytes} B from {m.peer}" for m in op.recvs(device)]
    return ", ".join(parts) or "nothing for this device"

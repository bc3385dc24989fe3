"""Plan-independent checkpoints: every parameter and AdamW moment as one full tensor, by name.

A checkpoint is one safetensors file, ``DIR/checkpoint.safetensors``: the Hugging Face parameter names
(``model.layers.3.mlp.up_proj.weight``), ``NAME.exp_avg`` and ``NAME.exp_avg_sq``, and in its metadata
the format, the model and the number of steps done. Nothing in it depends on the plan that wrote it, so
any plan of the same model can load it.

Saving is collective: the full tensors are assembled on the strategy's first device with the comm
layer's fused BSR (destination layout "whole tensor on one device"), a bounded number of bytes per
round, and written atomically by that device. Loading is local: each device reads, from the lazily
opened file, exactly the region of each tensor that its program holds.

Under ZeRO-1 (``training.zero``, runtime/engine/zero.py) a sharded parameter's moments are kept as
pieces: one contiguous run of each of its slices per device. Saving moves each slice's moment as a 1-D
tensor split (HDim 0, uneven) over the devices holding its pieces, in the same fused BSR; loading reads
just this device's pieces (``DeviceProgram.moment_pieces()``). So either side may use ZeRO-1 or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import HspmdError, Problem, SpecError
from runtime.models.params import llama_parameters
from runtime.spec import ModelSpec, PlanContext
from runtime.spec.io import atomic_write_bytes

if TYPE_CHECKING:
    import torch

CHECKPOINT_FILE = "checkpoint.safetensors"
FORMAT = "hspmd-checkpoint/1"
STATE_SUFFIXES = ("", ".exp_avg", ".exp_avg_sq")  # the parameter, then AdamW's two moments
STATE_DTYPE = "float32"  # master weights and moments (bf16 is only autocast compute)
ROUND_BYTES = 256 * 2**20  # full-tensor bytes gathered per BSR round (bounds the writer's memory)


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    model: str
    saved_by: str  # plan file and strategy that wrote it (informational)


def expected_tensors(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``model`` holds, with its full shape, in module order."""
    return {info.name + suffix: info.shape for info in llama_parameters(model) for suffix in STATE_SUFFIXES}


def checkpoint_path(directory: str | Path) -> Path:
    return Path(directory) / CHECKPOINT_FILE


def read_checkpoint_info(directory: str | Path, plan: PlanContext) -> CheckpointInfo:
    """Check that ``directory`` holds a checkpoint that ``plan``'s model can load (reads the header only)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    path = checkpoint_path(directory)
    if not directory.is_dir():
        raise HspmdError(f"{directory}: --load: no such directory")
    if not path.is_file():
        raise HspmdError(f"{directory}: --load: no checkpoint in this directory ({CHECKPOINT_FILE} not found)")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise HspmdError(f"{path}: not a readable safetensors checkpoint: {exc}") from None
    problems: list[Problem] = []
    if meta.get("format") != FORMAT:
        problems.append(Problem(str(path), "metadata.format", f"expected {FORMAT!r}, got {meta.get('format')!r}"))
    step = meta.get("step", "")
    if not step.isdigit():
        problems.append(Problem(str(path), "metadata.step", f"expected a step count, got {step!r}"))
    model = plan.model
    for name, shape in expected_tensors(model).items():
        if name not in shapes:
            problems.append(Problem(str(path), name, f"missing (model {model.name} needs it)"))
        elif shapes[name] != shape:
            problems.append(Problem(str(path), name, f"has shape {list(shapes[name])}, model {model.name} needs "
                                                     f"{list(shape)} (saved for model {meta.get('model')!r})"))
    if problems:
        raise SpecError(problems)
    return CheckpointInfo(path, int(step), meta.get("model", ""), meta.get("saved_by", ""))


def save_checkpoint(program: Any, groups: Any, directory: str | Path, *, plan: PlanContext, strategy: str,
                    step: int) -> None:
    """Collective over every device of ``strategy``: write ``directory``/checkpoint.safetensors."""
    import torch

    from runtime.annotations import Annotation
    from runtime.annotations.from_plan import annotate_strategy
    from runtime.comm.bsr import TensorMove, plan_bsr
    from runtime.comm.execute import run_bsr
    from runtime.engine.zero import moment_pieces, zero_slices

    strat = plan.plan.strategy(strategy)
    me = groups.my_device
    writer = min(strat.devices)
    local = dict(program.local_state())
    ann = annotate_strategy(strat, plan.model, plan.plan.training)
    params = ann.params
    _check_local_regions(program, {p.name: p for p in params}, me)
    slices = zero_slices(ann) if plan.plan.training.zero else {}
    if slices and program.moment_pieces() != moment_pieces(slices, me):
        raise RuntimeError(f"device {me}: the program's ZeRO-1 moment pieces differ from the plan's")
    dtype = getattr(torch, STATE_DTYPE)
    moves = []
    for p in params:
        for suffix in STATE_SUFFIXES:
            if suffix and p.name in slices:
                moves.extend(_zero_moves(p.name + suffix, slices[p.name], writer, dtype, me, local))
                continue
            moves.append(TensorMove(p.name + suffix, p.shape, dtype, p.param, Annotation.spmd([writer])))
    for name in (m.name for m in moves if m.name in local):
        if local[name].dtype != dtype:
            raise RuntimeError(f"{name}: local state is {local[name].dtype}, checkpoints hold {dtype}")
    full: dict[str, torch.Tensor] = {}
    for chunk in _rounds(moves):
        got = run_bsr(plan_bsr(chunk, bandwidth=plan.cluster),
                      {m.name: local[m.name] for m in chunk if m.name in local}, groups)
        if me == writer:
            full.update({k: v.detach().to("cpu").contiguous() for k, v in got.items()})
    if me != writer:
        return
    for p in params:
        for suffix in STATE_SUFFIXES[1:] if p.name in slices else ():
            whole = torch.empty(p.shape, dtype=dtype)
            for i, s in enumerate(slices[p.name]):
                whole[tuple(slice(a, b) for a, b in s.region)] = full.pop(f"{p.name}{suffix}@{i}").view(s.shape)
            full[p.name + suffix] = whole
    from safetensors.torch import save

    meta = {"format": FORMAT, "step": str(step), "model": plan.model.name,
            "saved_by": f"{plan.path} (strategy {strat.name})"}
    atomic_write_bytes(checkpoint_path(directory), save(full, metadata=meta))


def load_checkpoint(program: Any, directory: str | Path, plan: PlanContext) -> int:
    """Load this device's shards of every parameter and AdamW moment; return the steps already done."""
    import torch
    from safetensors import safe_open

    info = read_checkpoint_info(directory, plan)
    state: dict[str, torch.Tensor] = {}
    pieces = program.moment_pieces() if plan.plan.training.zero else {}
    with safe_open(info.path, framework="pt", device="cpu") as f:
        for name, shard in program.param_annotations().items():
            for suffix in STATE_SUFFIXES:
                if suffix and name in pieces:  # ZeRO-1: only this device's pieces of the moment
                    src = f.get_slice(name + suffix)
                    state[name + suffix] = torch.cat([src[tuple(slice(a, b) for a, b in p.region)].reshape(-1)
                                                      [p.start:p.stop] for p in pieces[name]])
                    continue
                state[name + suffix] = f.get_slice(name + suffix)[shard.region].contiguous()
    state["step"] = torch.tensor(float(info.step))
    program.load_local_state(state)
    return info.step


def _zero_moves(key: str, slices: Any, writer: int, dtype: Any, me: int, local: dict[str, Any]) -> list[Any]:
    """A ZeRO-1 moment as one 1-D tensor per slice (``KEY@i``), split over the devices that keep its
    pieces; this device's local pieces are put into ``local`` under those names."""
    from runtime.annotations import Annotation, DistributedStates
    from runtime.comm.bsr import TensorMove

    mine = local.pop(key, None)
    off = 0
    moves = []
    for i, s in enumerate(slices):
        owners = [(d, s.chunk(d)) for d in s.devices if s.chunk(d)[1] > s.chunk(d)[0]]
        src = Annotation.union(0, [((d,), DistributedStates.of()) for d, _ in owners], [b - a for _, (a, b) in owners])
        moves.append(TensorMove(f"{key}@{i}", (s.numel,), dtype, src, Annotation.spmd([writer])))
        if me in s.devices:
            a, b = s.chunk(me)
            if b > a:
                local[f"{key}@{i}"] = mine[off:off + b - a]
            off += b - a
    if mine is not None and off != mine.numel():
        raise RuntimeError(f"{key}: device {me} keeps {mine.numel()} ZeRO-1 moment elements, its pieces {off}")
    return moves


def _rounds(moves: list[Any]) -> list[list[Any]]:
    out: list[list[Any]] = [[]]
    size = 0
    for m in moves:
        nbytes = m.itemsize * math.prod(m.shape)
        if out[-1] and size + nbytes > ROUND_BYTES:
            out.append([])
            size = 0
        out[-1].append(m)
        size += nbytes
    return out


def _check_local_regions(program: Any, params: dict[str, Any], me: int) -> None:
    """The engine's own view of what it holds must match the plan's annotations, or the BSR would move
    the wrong slices."""
    for name, shard in program.param_annotations().items():
        region = tuple((s.start, s.stop) for s in shard.region)
        expected = params[name].param.layout(params[name].shape).region(me)
        if region != expected:
            raise RuntimeError(f"{name}: device {me} holds region {region}, the plan's annotation says {expected}")

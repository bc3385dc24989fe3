"""Plan strategy -> HSPMD annotations of every parameter, gradient, input batch and boundary activation.

The rules (docs/design.md §2, docs/formats.md "Plan"):

* a decoder layer's parameter is held by every pipeline, by the stage one of whose layer ranges (model
  chunks) contains it: HDim -1 over those stages' TP groups, member i laid out by its own TP degree
  (``ParamInfo.tp_dim``: Split(tp_dim) x TP, or duplicate x TP for norms); the embedding lives on the
  stage holding layer 0, the final norm and head on the stage holding the last layer (the last stage,
  or under ZB-V the first); a tied embedding on both (one weight, two device groups per pipeline when
  they differ: its gradient sums the lookup's and the head's summands like any HDim -2 member's);
* its gradient: the same members with HDim -2 (each pipeline computed a summand);
* the input batch ``(global_batch, seq_len)``: HDim 0 over pipelines, weighted by their micro-batch
  counts; inside a pipeline only the first stage's devices hold tokens (duplicated in its TP group),
  labels only the last stage's;
* the activation between virtual stage j and j+1 of a pipeline (consecutive model chunks on different
  stages), ``(micro_batch, seq_len, hidden)``: duplicate in the TP group of the producing stage ->
  duplicate in the TP group of the consuming stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from runtime.torchfree.annotations.states import DUPLICATE, PARTIAL, Annotation, DistributedStates
from runtime.torchfree.models.decoders import model_parameters
from runtime.torchfree.models.params import ParamInfo
from runtime.torchfree.spec.handle import StrategyHandle
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Stage, Strategy, TrainingSettings


@dataclass(frozen=True)
class ParamAnnotation:
    info: ParamInfo
    param: Annotation  # HDim -1 (or plain SPMD when one pipeline holds it)
    grad: Annotation  # HDim -2 with the same members

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape


@dataclass(frozen=True)
class Boundary:
    """The activation sent from virtual stage ``stage`` to ``stage + 1`` of pipeline ``pipeline``: from
    the chunk of plan stage ``src_stage`` to the chunk of ``dst_stage`` (with one chunk per stage,
    ``stage`` -> ``stage + 1``). Consecutive chunks on one stage have no boundary."""

    pipeline: int
    stage: int
    shape: tuple[int, ...]
    src: Annotation
    dst: Annotation
    src_stage: int
    dst_stage: int


@dataclass(frozen=True)
class StrategyAnnotations:
    strategy: str
    params: tuple[ParamAnnotation, ...]
    batch_shape: tuple[int, int]  # (global_batch, seq_len)
    tokens: Annotation
    labels: Annotation
    boundaries: tuple[Boundary, ...]

    def param(self, name: str) -> ParamAnnotation:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def member_states(stage: Stage, tp_dim: int | None) -> DistributedStates:
    """The bottom-tier DS of a parameter in one TP group."""
    return _tp_states(stage.tp, tp_dim)


@cache
def _tp_states(tp: int, tp_dim: int | None) -> DistributedStates:
    if tp == 1:
        return DistributedStates.of()
    if tp_dim is None:
        return DistributedStates.duplicate(tp)
    return DistributedStates.split(tp_dim, tp)


def holding_stages(strategy: Strategy, info: ParamInfo) -> list[Stage]:
    """The stages that hold a parameter: one per pipeline (two for a tied embedding), in pipeline order."""
    out = []
    for pipe in strategy.pipelines:
        if info.owner == "embedding":
            out.append(pipe.stages[pipe.embed_stage])
            if info.tied and pipe.head_stage != pipe.embed_stage:
                out.append(pipe.stages[pipe.head_stage])
        elif info.owner == "head":
            out.append(pipe.stages[pipe.head_stage])
        else:
            assert info.layer is not None
            out.append(next(s for s in pipe.stages if s.holds_layer(info.layer)))
    return out


Member = tuple[tuple[int, ...], DistributedStates, DistributedStates]
"""A parameter in one holding stage: (devices, the parameter's DS over them, its gradient's DS)."""


def stage_member(stage: Stage, info: ParamInfo) -> Member:
    """Where a stage keeps a parameter and how its gradient comes out there (docs/moe.md).

    On an expert-parallel stage a routed expert lives whole on its holders, each of which computes the
    gradient of the tokens it was sent (a summand per holder); the router is on every device, each routing
    its own share of the tokens (a summand per device). Everything else follows the TP rule, whose
    duplicated tensors get the same gradient on every TP rank."""
    if stage.expert_parallel and info.expert is not None:
        holders = stage.expert_holders(info.expert)
        return holders, DistributedStates.duplicate(len(holders)), DistributedStates({PARTIAL: len(holders)})
    if stage.expert_parallel and info.router:
        return stage.devices, DistributedStates.duplicate(stage.tp), DistributedStates({PARTIAL: stage.tp})
    ds = member_states(stage, info.tp_dim)
    return stage.devices, ds, ds


def held_by(stages: Sequence[Stage], info: ParamInfo) -> ParamAnnotation:
    """A parameter's annotations when ``stages`` (one per pipeline) hold it."""
    return _annotations(info, tuple(stage_member(s, info) for s in stages))


def _annotations(info: ParamInfo, members: tuple[Member, ...]) -> ParamAnnotation:
    return ParamAnnotation(info, Annotation.union(DUPLICATE, [(d, p) for d, p, _ in members]),
                           Annotation.union(PARTIAL, [(d, g) for d, _, g in members]))


def placements(strategy: Strategy, model: ModelSpec) -> list[tuple[ParamInfo, tuple[Stage, ...]]]:
    """Every parameter (``model_parameters`` order) with the stages that hold it, one per pipeline."""
    by_owner: dict[tuple[str, int | None], tuple[Stage, ...]] = {}  # the tensors of one layer share stages
    out = []
    for info in model_parameters(model):
        key = (info.owner, info.layer)
        if key not in by_owner:
            by_owner[key] = tuple(holding_stages(strategy, info))
        out.append((info, by_owner[key]))
    return out


def param_annotations(strategy: Strategy, model: ModelSpec) -> tuple[ParamAnnotation, ...]:
    """Every parameter's annotations, in ``model_parameters`` order (no batch needed: what the gradient
    sync and ZeRO-1 read). Layers placed alike share annotation objects."""
    shared: dict[tuple[object, ...], tuple[Annotation, Annotation]] = {}
    out = []
    for info, stages in placements(strategy, model):
        members = tuple(stage_member(s, info) for s in stages)
        if members not in shared:
            p = _annotations(info, members)
            shared[members] = (p.param, p.grad)
        out.append(ParamAnnotation(info, *shared[members]))
    return tuple(out)


def annotate_strategy(strategy: Strategy, model: ModelSpec, training: TrainingSettings) -> StrategyAnnotations:
    """Every annotation the runtime needs to run ``strategy``."""
    params = param_annotations(strategy, model)
    weights = [p.micro_batches for p in strategy.pipelines]
    firsts = [(p.stages[p.embed_stage].devices, DistributedStates.duplicate(p.stages[p.embed_stage].tp))
              for p in strategy.pipelines]
    lasts = [(p.stages[p.head_stage].devices, DistributedStates.duplicate(p.stages[p.head_stage].tp))
             for p in strategy.pipelines]
    tokens = Annotation.union(0, firsts, weights)
    labels = Annotation.union(0, lasts, weights)
    act = (training.micro_batch, training.seq_len, model.hidden_size)
    boundaries = []
    for pi, pipe in enumerate(strategy.pipelines):
        order = pipe.chunk_order()
        for j in range(len(order) - 1):
            si, ti = order[j][0], order[j + 1][0]
            if si != ti:
                a, b = pipe.stages[si], pipe.stages[ti]
                boundaries.append(Boundary(pi, j, act, Annotation.spmd(a.devices), Annotation.spmd(b.devices),
                                           si, ti))
    return StrategyAnnotations(strategy.name, params, (training.global_batch, training.seq_len), tokens, labels,
                               tuple(boundaries))


def strategy_annotations(handle: StrategyHandle) -> StrategyAnnotations:
    """``annotate_strategy`` of a handle, computed once per handle."""
    return handle.cached(_annotate)


def _annotate(handle: StrategyHandle) -> StrategyAnnotations:
    return annotate_strategy(handle.strategy, handle.model, handle.training)


def strategy_groups(strategy: Strategy, model: ModelSpec, training: TrainingSettings) -> list[tuple[int, ...]]:
    """Every device group (sorted ids, size >= 2) the runtime of ``strategy`` needs, in creation order.

    TP groups (DTensor meshes), gradient-sync groups (SplitAllReduce slices), collectives of the
    stage-boundary ops, and the whole strategy (global reductions such as the gradient norm).
    """
    from runtime.torchfree.comm.resolve import plan_reduce, resolve

    keys = {tuple(sorted(st.devices)) for pipe in strategy.pipelines for st in pipe.stages}
    keys.add(tuple(sorted(strategy.devices)))
    ann = annotate_strategy(strategy, model, training)
    seen: set[tuple[Annotation, tuple[int, ...]]] = set()
    for p in ann.params:
        if (p.grad, p.shape) in seen:
            continue
        seen.add((p.grad, p.shape))
        lay = p.grad.layout(p.shape)
        if lay.is_partial:
            keys.update(b.devices for b in plan_reduce(lay, None))
    for b in ann.boundaries:
        keys.update(resolve(b.src, b.dst, b.shape).groups())
    return sorted((k for k in keys if len(k) > 1), key=lambda k: (len(k), k))


def _placement(strategy: Strategy, model: ModelSpec, layer: int) -> tuple[object, ...]:
    """What makes a layer's rows differ from its neighbour's: its stages and whether it routes to experts."""
    return (model.is_moe_layer(layer), *(next(s.devices for s in p.stages if s.holds_layer(layer))
                                         for p in strategy.pipelines))


def annotation_rows(strategy: Strategy, model: ModelSpec, training: TrainingSettings) -> list[dict[str, Any]]:
    """Rows for ``hspmd show --annotations``: layers with the same placement grouped into ranges."""
    from runtime.torchfree.comm.resolve import resolve

    ann = annotate_strategy(strategy, model, training)
    rows: list[dict[str, Any]] = []
    sync_kind: dict[tuple[Annotation, tuple[int, ...]], str] = {}

    def param_row(where: str, layers: list[int] | None, p: ParamAnnotation, short: str) -> dict[str, Any]:
        key = (p.grad, p.shape)
        if key not in sync_kind:
            sync_kind[key] = resolve(p.grad, p.param, p.shape).kind
        return {"where": where, "layers": layers, "tensor": short, "kind": "parameter", "shape": list(p.shape),
                "annotation": p.param.to_data(), "text": str(p.param), "grad_hdim": p.grad.hdim,
                "sync": sync_kind[key]}

    def short(name: str) -> str:   # a module's own name: embed_tokens.weight, wte.weight, ln_f.bias, lm_head.weight
        return ".".join(name.split(".")[-2:])

    rows += [param_row("embedding", None, p, short(p.name)) for p in ann.params if p.info.owner == "embedding"]
    start = 0
    for layer in range(1, model.num_layers + 1):
        if layer < model.num_layers and _placement(strategy, model, layer) == _placement(strategy, model, start):
            continue
        # The layer's module prefix differs by architecture (model.layers.3., transformer.h.3., ...).
        rows += [param_row(f"layers {start}-{layer - 1}", [start, layer], p, p.name.split(f".{start}.", 1)[1])
                 for p in ann.params if p.info.layer == start]
        start = layer
    rows += [param_row("head", None, p, short(p.name)) for p in ann.params if p.info.owner == "head"]
    for name, a in (("tokens", ann.tokens), ("labels", ann.labels)):
        rows.append({"where": "batch", "layers": None, "tensor": name, "kind": "input",
                     "shape": list(ann.batch_shape), "annotation": a.to_data(), "text": str(a), "grad_hdim": None,
                     "sync": None})
    for b in ann.boundaries:
        op = resolve(b.src, b.dst, b.shape)
        rows.append({"where": f"pipeline {b.pipeline}", "layers": None,
                     "tensor": f"activation stage {b.src_stage}->{b.dst_stage}"
                               + ("" if (b.src_stage, b.dst_stage) == (b.stage, b.stage + 1)
                                  else f" (virtual stage {b.stage}->{b.stage + 1})"),
                     "kind": "activation",
                     "shape": list(b.shape), "annotation": b.dst.to_data(), "text": f"{b.src} -> {b.dst}",
                     "grad_hdim": None, "sync": op.kind})
    return rows

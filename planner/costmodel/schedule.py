"""Pipeline schedule prices: a model chunk's F, B and W, a pipeline's action lists played with them
(runtime/torchfree/pipeline_schedules.py), the closed-form ranking proxies."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.costmodel.base import memo, recomputed
from planner.costmodel.targets import SPLIT_BACKWARD_SHARE
from runtime.torchfree.pipeline_schedules import ChunkCost, Costs, TimedOp, op_kinds, step_time, step_time_bound
from runtime.torchfree.pipeline_schedules import Schedule as PipelineSchedule
from runtime.torchfree.profiling.profile import (
    eval_fit,
)
from runtime.torchfree.schedule_policies import Layout, schedule_layout
from runtime.torchfree.spec.handle import plan_order, plan_schedule
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import OpCosts, Pipeline, Schedule, Stage, Strategy


def pipeline_time(forward_s: Sequence[float], backward_s: Sequence[float], micro_batches: int,
                  schedule: Schedule = "1f1b", boundary_s: Sequence[float] = ()) -> float:
    """Time of one pipeline for one step, closed form (docs/design.md §5).

    1F1B: ``(m-1) * max_s(f_s + b_s) + sum_s(f_s + b_s) + sum(boundary)``; GPipe runs all forwards, then
    all backwards: ``(m-1)*max(f) + sum(f) + (m-1)*max(b) + sum(b) + sum(boundary)``. ``boundary_s``
    is the fill-and-drain cost of each stage boundary (forward activation plus backward gradient).
    Exact for equal stages without communication; an estimate otherwise (the simulator is exact).
    """
    m = micro_batches
    if schedule == "1f1b":
        t = [f + b for f, b in zip(forward_s, backward_s)]
        return (m - 1) * max(t) + sum(t) + sum(boundary_s)
    return (m - 1) * (max(forward_s) + max(backward_s)) + sum(forward_s) + sum(backward_s) + sum(boundary_s)


def timeline_order(layout: Layout, kinds: Sequence[str], timeline: Sequence[Sequence[TimedOp]]
                   ) -> tuple[tuple[int, ...], ...]:
    """A timeline's op order as op numbers (``runtime.torchfree.pipeline_schedules.schedule_order``)."""
    n, index = layout.num_stages, {k: i for i, k in enumerate(kinds)}
    return tuple(tuple((t.op.micro_batch * n + t.op.stage) * len(kinds) + index[t.op.kind] for t in ops)
                 for ops in timeline)


def play_order(layout: Layout, kinds: Sequence[str], order: Sequence[Sequence[int]], costs: Costs) -> float:
    """What the timeline whose op order is ``order`` takes when played (op numbers over ``kinds``,
    ``schedule_order``): the same arithmetic in the same order per op, so the same float to the bit
    (tests/unit/planner/test_fast_pricing.py), with each op's duration, the message it waits for and the
    transfer its output takes looked up by number instead of read from a ``TimedOp``."""
    n, nk = layout.num_stages, len(kinds)
    per_mb = n * nk
    dev = [layout.device(j) for j in range(n)]
    dur: list[float] = []
    src: list[int] = []               # per op of one micro-batch: the op (offset) whose message it waits for, 0: none
    out: list[float | None] = []      # the transfer time its output takes to another device, None: none
    for j in range(n):
        cc = costs.chunk(dev[j], layout.chunk(j))
        for kind in kinds:
            dur.append(cc.of(kind))  # type: ignore[arg-type]
            back = kind in ("B", "BW")
            if kind == "F" and j > 0 and dev[j - 1] != dev[j]:
                src.append(-nk)       # the previous stage's F of this micro-batch
            elif back and j < n - 1 and dev[j + 1] != dev[j]:
                src.append(nk)        # the next stage's backward
            else:
                src.append(0)
            if kind == "F" and j < n - 1 and dev[j + 1] != dev[j]:
                out.append(costs.transfer(j))
            elif back and j > 0 and dev[j - 1] != dev[j]:
                out.append(costs.transfer(j - 1))
            else:
                out.append(None)
    arrival: list[float | None] = [None] * sum(len(ops) for ops in order)
    clock = [0.0] * layout.num_devices
    pos = [0] * layout.num_devices
    last = 0.0
    moved = True
    while moved:
        moved = False
        for d, ops in enumerate(order):
            t, p, size = clock[d], pos[d], len(ops)
            while p < size:
                o = ops[p]
                r = o % per_mb
                if src[r]:
                    a = arrival[o + src[r]]
                    if a is None:
                        break   # its sender has not got there yet
                    if a > t:   # (``max(t, a)``)
                        t = a
                t += dur[r]
                if t > last:
                    last = t
                x = out[r]
                if x is not None:
                    arrival[o] = t + x
                p += 1
                moved = True
            clock[d], pos[d] = t, p
    if any(p < len(ops) for p, ops in zip(pos, order)):
        raise RuntimeError("the action lists deadlock (a runtime schedule bug, not a user error)")
    return last


def weight_grad_fraction(model: ModelSpec, seq_len: int, num_layers: int, head: bool,
                         in_input_grad: int = 0) -> float:
    """The weight-gradient (W) share of a chunk's backward compute, by FLOPs (docs/design.md §10).

    Per token, a decoder layer's forward runs ``2P`` matmul FLOPs (P its parameters) and ``4hs``
    attention FLOPs (PaLM's count, as ``model_flops_per_token``). Its backward computes the input
    gradients, ``2P + 8hs`` (the attention's backward is all input gradient: it has no weights), and the
    weight gradients, ``2P``. The head adds ``2Vh`` to each half; the embedding's backward is a
    scatter-add (no FLOPs). The profiles time the backward as one block, so W is this share of it and B
    the rest; recompute and TP collectives stay with B (the recompute forward runs before the input
    gradients; the row-parallel input-gradient all-reduce is B's). ``in_input_grad``: layers whose weight
    gradients B computes itself (partial recompute's recomputed layers: the engine does not defer them, as
    deferring would rerun their forward once more), so they are not W's."""
    p, h = model.layer_params(), model.hidden_size
    head_flops = 2.0 * model.vocab_size * h if head else 0.0
    w = (num_layers - in_input_grad) * 2.0 * p + head_flops
    total = num_layers * (4.0 * p + 8.0 * h * seq_len) + 2.0 * head_flops
    return w / total if total > 0 else 0.0


class ScheduleCosts:
    """Schedule prices of a ``CostModel`` (planner/cost.py)."""

    # -- pipeline schedules (runtime/torchfree/pipeline_schedules.py) ---------------------------------------------

    @memo
    def chunk_cost(self, device_type: str, tp: int, num_layers: int, first: bool, last: bool,
                   recompute: bool = False, recompute_layers: int = 0) -> ChunkCost:
        """One micro-batch through one model chunk as the list scheduler times it: F, and the backward
        split into B (input gradients, what the previous chunk waits for) and W (weight gradients) by
        ``weight_grad_fraction`` of its backward compute; the fused backward is ``stage``'s. As the engine
        runs them (docs/schedules.md, the executor): the chunk holding layer 0 has no input gradient, its W
        is its whole backward; a chunk recomputing all its layers runs W as a second backward through the
        graph B kept; one recomputing some (partial recompute) computes their weight gradients in B."""
        r = recomputed(num_layers, recompute, recompute_layers)
        sc = self.stage(device_type, tp, num_layers, first, last, recompute_layers=r)
        tiny = 1e-6 * sc.backward_s   # ChunkCost wants both halves positive
        if self.sleep_target(device_type) is not None:
            # Sleep emulation prices each half at its share of the backward block (hetu_cli/emulation.py
            # stage_block_targets): what the emulated device then takes.
            half = SPLIT_BACKWARD_SHARE * sc.backward_s
            return ChunkCost(forward=sc.forward_s, input_grad=half, weight_grad=half, full_backward=sc.backward_s)
        if first:   # the engine runs the first chunk's W as its whole backward: it has no input gradient
            return ChunkCost(forward=sc.forward_s, input_grad=tiny, weight_grad=sc.backward_s - tiny,
                             full_backward=sc.backward_s)
        split = None if r else self._split_backward(device_type, tp, num_layers, last)
        if split is not None:   # measured: the two autograd passes cost more than the fused backward
            return ChunkCost(forward=sc.forward_s, input_grad=max(tiny, split[0]) + sc.tp_backward_s,
                             weight_grad=max(tiny, split[1]), full_backward=sc.backward_s)
        rerun = r * self.layer(device_type, tp, True).recompute_s
        backward_compute = sc.compute_s - (sc.forward_s - sc.tp_forward_s) - rerun
        partial = r if r < num_layers else 0
        w = weight_grad_fraction(self.model, self.seq_len, num_layers, last, partial) * max(0.0, backward_compute)
        w = min(max(w, tiny), sc.backward_s - tiny)
        b = sc.backward_s - w
        if r == num_layers:   # ... and a recompute chunk's W as one more backward through the kept graph
            w = max(tiny, backward_compute)
        return ChunkCost(forward=sc.forward_s, input_grad=b, weight_grad=w, full_backward=sc.backward_s)

    @memo
    def placed_chunk_cost(self, device_type: str, tp: int, start: int, stop: int,
                          recompute_layers: int = 0) -> ChunkCost:
        """``chunk_cost`` of the chunk holding decoder layers [start, stop), with the profile's per-layer
        overrides (``placed_stage``): F moves by their forward difference, B and W share the backward's in
        their own proportion."""
        n, first, last = stop - start, start == 0, stop == self.model.num_layers
        cc = self.chunk_cost(device_type, tp, n, first, last, recompute_layers=recompute_layers)
        placed = self.placed_stage(device_type, tp, ((start, stop),), first, last, recompute_layers=recompute_layers)
        plain = self.stage(device_type, tp, n, first, last, recompute_layers=recompute_layers)
        d_f, d_b = placed.forward_s - plain.forward_s, placed.backward_s - plain.backward_s
        if not (d_f or d_b):
            return cc
        grow = 1.0 + d_b / (cc.input_grad + cc.weight_grad)
        return ChunkCost(forward=cc.forward + d_f, input_grad=cc.input_grad * grow, weight_grad=cc.weight_grad * grow,
                         full_backward=None if cc.full_backward is None else cc.full_backward + d_b)

    def _split_backward(self, device_type: str, tp: int, num_layers: int, last: bool) -> tuple[float, float] | None:
        """(B, W) compute seconds of a chunk without the embedding as the profile measured a split backward
        (``MeasuredModel.split_blocks``), or None where it did not."""
        m = self._measured(device_type)
        split = None if m is None else m.split_blocks.get(tp)
        if split is None:
            return None
        b, s = self._shape(None, None)
        parts = [split["stage"]] + ([split["head"]] if last else [])
        return tuple(num_layers * eval_fit(getattr(split["layer"], f), b, s)  # type: ignore[return-value]
                     + sum(eval_fit(getattr(p, f), b, s) for p in parts) for f in ("forward_s", "backward_s"))

    def pipeline_costs(self, strategy: Strategy, pi: int, schedule: Schedule) -> Costs:
        """The list scheduler's costs of pipeline ``pi``: per stage and chunk its ``chunk_cost`` (the chunk
        holding layer 0 carries the embedding, the one holding the last layer the head), per virtual-stage
        boundary one activation's transfer (the slower direction; 0 where both sit on one stage)."""
        pipe = strategy.pipelines[pi]
        chunks = []
        for st in pipe.stages:
            chunks.append(tuple(self.stage_chunk(st, c)[1] for c in range(st.chunks)))
        layout = schedule_layout(schedule, len(pipe.stages), pipe.stages[0].chunks)
        boundary = []
        for j in range(layout.num_stages - 1):
            a, b = pipe.stages[layout.device(j)], pipe.stages[layout.device(j + 1)]
            boundary.append(0.0 if a is b else max(self.p2p_time(a.devices, b.devices),
                                                   self.p2p_time(b.devices, a.devices)))
        return Costs(tuple(chunks), tuple(boundary))

    def pipeline_step_time(self, strategy: Strategy, pi: int, schedule: Schedule) -> float:
        """Pipeline ``pi``'s part of the step under its schedule (``schedule`` unless it names its own): the
        action lists the runtime executes (``runtime_schedule``) played with the real op costs
        (played from their op order, ``play_order``, which gives the number the lists give
        without deriving the lists or building the timeline), cached."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        costs = self.pipeline_costs(strategy, pi, name)
        key = self._schedule_key(pipe, name)
        layout = schedule_layout(name, len(pipe.stages), pipe.stages[0].chunks)
        kinds = op_kinds(name)
        full = self.__dict__.get("_runtime_schedules", {}).get(key)
        orders = self.__dict__.setdefault("_runtime_orders", {})
        if key not in orders:
            orders[key] = timeline_order(layout, kinds, full.timeline) if full is not None else \
                plan_order(pipe, name, pipe.micro_batches)
        order = orders[key]
        cache = self.__dict__.setdefault("_step_times", {})
        played = (id(order), costs)
        if played not in cache:
            cache[played] = play_order(layout, kinds, order, costs)
        return cache[played]

    def pipeline_step_bound(self, strategy: Strategy, pi: int, schedule: Schedule) -> float:
        """A lower bound of ``pipeline_step_time`` that builds no lists (``step_time_bound``): a search that
        compares exact prices skips the plans this shows cannot win."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        return step_time_bound(name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks,
                               self.pipeline_costs(strategy, pi, name))

    def ideal_step_time(self, strategy: Strategy, pi: int, schedule: Schedule) -> float:
        """The list scheduler run on the priced costs, transfers included (``step_time``): what
        ``pipeline_step_time`` would be if the runtime's lists were ordered knowing the transfer times and
        the fused backward. The runtime orders by the plan's op costs without those (else by layer counts:
        docs/schedules.md, "Costs in the plan"), so the two can differ."""
        pipe = strategy.pipelines[pi]
        name = pipe.schedule if pipe.schedule is not None else schedule
        costs = self.pipeline_costs(strategy, pi, name)
        key = (name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks, costs, pipe.activation_limits)
        cache = self.__dict__.setdefault("_ideal_times", {})
        if key not in cache:
            cache[key] = step_time(name, len(pipe.stages), pipe.micro_batches, pipe.stages[0].chunks, costs,
                                   pipe.activation_limits)
        return cache[key]

    def runtime_schedule(self, strategy: Strategy, pi: int, schedule: Schedule) -> PipelineSchedule:
        """The ``Schedule`` the runtime executes for pipeline ``pi`` (``schedule`` the default unless it names
        its own): ``plan_schedule``, the function ``StrategyHandle.pipeline_schedule`` builds it by, from the
        pipeline's layers and ``op_costs`` (planned strategies carry them: ``with_op_costs``), cached."""
        pipe = strategy.pipelines[pi]
        if pipe.schedule is not None:
            schedule = pipe.schedule
        key = self._schedule_key(pipe, schedule)
        cache = self.__dict__.setdefault("_runtime_schedules", {})
        if key not in cache:
            cache[key] = plan_schedule(pipe, schedule, pipe.micro_batches)
        return cache[key]

    @staticmethod
    def _schedule_key(pipe: Pipeline, schedule: Schedule) -> tuple:
        """What ``plan_schedule`` builds a pipeline's lists from. With every stage's op costs the lists
        depend on them, not on which layers the chunks hold."""
        costed = all(st.op_costs is not None for st in pipe.stages)
        return (schedule, pipe.micro_batches, pipe.transfer_costs, pipe.activation_limits,
                tuple(st.op_costs if costed else (st.layers, st.op_costs) for st in pipe.stages))

    def stage_op_costs(self, st: Stage) -> tuple[OpCosts, ...]:
        """A stage's ``op_costs`` for the plan: each chunk's ``chunk_cost`` (F, B, W), the numbers the
        estimate prices, so that the runtime orders its lists by them."""
        out = []
        for k in range(st.chunks):
            c = self.stage_chunk(st, k)[1]
            out.append((c.forward, c.input_grad, c.weight_grad))
        return tuple(out)

    def costed_pipeline(self, pipe: Pipeline, schedule: Schedule) -> Pipeline:
        """``pipe`` with the costs the planner writes into a plan, so that the runtime orders its lists by
        them: each stage's ``op_costs`` (``stage_op_costs``) and the pipeline's ``transfer_costs``
        (``pipeline_costs``' boundaries), under its own schedule, else ``schedule``."""
        name = pipe.schedule if pipe.schedule is not None else schedule
        stages = tuple(dataclasses.replace(st, op_costs=self.stage_op_costs(st)) for st in pipe.stages)
        bare = dataclasses.replace(pipe, stages=stages, transfer_costs=None)
        boundary = self.pipeline_costs(Strategy(name="pipeline", pipelines=(bare,)), 0, name).boundary
        return dataclasses.replace(bare, transfer_costs=boundary)

    def with_op_costs(self, strategy: Strategy, schedule: Schedule) -> Strategy:
        """``strategy`` with every pipeline's costs (``costed_pipeline``): what the planner writes, and so
        what it prices (docs/design.md §10)."""
        return dataclasses.replace(strategy, pipelines=tuple(self.costed_pipeline(p, schedule)
                                                             for p in strategy.pipelines))

    def pipeline_proxy_time(self, strategy: Strategy, pi: int) -> float:
        """1F1B's closed form (``pipeline_time``) on pipeline ``pi``'s whole stages: a cheap ranking proxy
        for the list scheduler's time (``pipeline_step_time``), which the best plans then get."""
        pipe = strategy.pipelines[pi]
        stages = [self.stage_total(s) for s in pipe.stages]
        boundary = [self.p2p_time(a.devices, b.devices) + self.p2p_time(b.devices, a.devices)
                    for a, b in zip(pipe.stages, pipe.stages[1:])]
        return pipeline_time([s.forward_s for s in stages], [s.backward_s for s in stages], pipe.micro_batches,
                             "1f1b", boundary)

"""Mixture-of-experts prices: a MoE layer on a stage whose experts are split over its TP group like the dense
MLP, and on an expert-parallel stage (``Stage.experts``) whose devices hold whole experts and exchange tokens
by all-to-all (docs/planning.md, "Mixture of experts").

Where the time comes from: profiles measure dense layers (``hspmd profile`` refuses a MoE model), so a MoE
layer is the dense layer of the same shapes (attention, norms and TP collectives from the profile as for any
model) with its MLP replaced: the router, the routed experts and the shared experts are GEMMs priced at the
time per FLOP the profile gives the dense SwiGLU MLP at this micro-batch shape, on each device's own type,
plus the MLP's fixed time per call once per block that computes (``gemms``: planner/costmodel/moe_gemms.py,
the rule). Expert GEMMs on fewer rows run at the dense MLP's time per FLOP: an assumption ``hspmd plan`` and
``hspmd simulate`` state (runtime/torchfree/spec/model.py ``MOE_PRICING``, ``ModelSpec.pricing_note``).

On a TP-split stage every rank computes every routed (token, expert) pair on its width slice; the router's
skew does not matter there (only the capacity factor's cut does). On an expert-parallel stage of n devices:
the T tokens of a micro-batch are cut in n slices, each rank routes its slice, (token, expert) pairs go to a
holder of their expert by all-to-all (a replicated expert's holders h_0..h_{m-1} take the pairs of source rank
s at h_{s mod m}), each holder runs its experts on the rows it received, the results come back by the
reverse all-to-all, and the slices are all-gathered; the backward reverses both all-to-alls and all-gathers
the input-gradient slices. The stage's MoE time is the slowest device's (its experts' rows on its own type)
plus those exchanges, priced over the links between the devices (``concurrent_seconds``). Attention and the
shared experts run under TP over the stage's devices at its slowest member's pace.

``layer`` (what the search prices a stage of a type and TP degree by) prices a multi-device stage's MoE
layers the faster way, TP-split or expert-parallel on a reference placement (``ep_reference``: the type's
first devices on one node, experts placed by load), as the planner then chooses per stage
(planner/moe_placement.py); ``stage_chunk`` prices a stage of a plan as its ``experts`` say (TP-split where
it has none). A model whose layers are not all MoE layers (``dense_layers``, ``sparse_step``):
``layer`` prices the mean layer (what the planner's ILPs take, layers being alike there); ``placed_stage`` and
``stage_chunk`` price the exact layer indices a chunk holds.

A sleep-mode emulated type's blocks last its target's prices (planner/costmodel/targets.py): its dense block
is the target's, and its MoE layers' GEMMs are priced on the target's profile and shapes (``gemms``) by the
same rules, each device of an expert-parallel stage by its own experts' rows, as the emulation's block targets
(hetu_cli/emulation.py) sleep them; the exchanges and TP collectives run inside those blocks (no
communication priced for them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from planner.costmodel.base import LayerCost, MemoryBreakdown, StageCost, memo
from planner.costmodel.moe_gemms import MoeGemms, expert_rows, holder_rows
from planner.costmodel.network import Flow, concurrent_seconds
from planner.costmodel.targets import slowest_target
from runtime.torchfree.profiling.profile import eval_fit
from runtime.torchfree.schedule_policies import device_limits
from runtime.torchfree.schedule_types import ChunkCost
from runtime.torchfree.spec.plan import Schedule, Stage, Strategy, expert_destination

# Bytes of one routed-token count in the counts all-gather ([n, E] int64).
COUNT_BYTES = 8
# Router logits and probabilities, kept for the backward in fp32.
ROUTER_ACT_BYTES = 8


def a2a_flows(devices: Sequence[int], experts: Mapping[int, Sequence[int]] | Sequence, rows: Sequence[float],
              row_bytes: float) -> tuple[Flow, ...]:
    """The dispatch all-to-all's messages (the combine sends the same ones back): source rank s sends its
    slice's rows of expert e to the expert's holder ``h[s mod m]``."""
    held = dict(experts)
    n = len(devices)
    nbytes: dict[tuple[int, int], float] = {}
    for e, r in enumerate(rows):
        holders = [d for d in devices if e in held.get(d, ())]
        for s, src in enumerate(devices):
            dst = expert_destination(holders, s)
            nbytes[src, dst] = nbytes.get((src, dst), 0.0) + r / n * row_bytes
    return tuple(Flow(a, b, x) for (a, b), x in nbytes.items())


def lpt_placement(devices: Sequence[int], rows: Sequence[float], per_row: Mapping[int, float],
                  caps: Mapping[int, int]) -> dict[int, list[int]]:
    """Longest processing time first: the heaviest expert (by ``rows``) to the device that would finish it
    first (``per_row``: its seconds per row), no device over ``caps`` experts where another has room; then
    every device left without one takes a replica of the expert whose holders take longest."""
    devices = list(devices)
    load = dict.fromkeys(devices, 0.0)
    place: dict[int, list[int]] = {d: [] for d in devices}
    for e in sorted(range(len(rows)), key=lambda e: (-rows[e], e)):
        room = [d for d in devices if len(place[d]) < caps[d]] or devices
        d = min(room, key=lambda d: ((load[d] + rows[e]) * per_row[d], len(place[d]), devices.index(d)))
        place[d].append(e)
        load[d] += rows[e]
    for d in devices:
        if not place[d]:
            holders = {e: [h for h in devices if e in place[h]] for e in range(len(rows))}
            e = max(range(len(rows)), key=lambda e: (max(rows[e] / len(holders[e]) * per_row[h]
                                                         for h in holders[e]), -e))
            place[d].append(e)
    return place


@dataclass(frozen=True)
class EpLayer:
    """One MoE layer of an expert-parallel stage, one micro-batch, against the TP-split MoE layer of the
    stage's slowest type at its TP degree (what ``layer`` prices): ``forward_s`` / ``backward_s`` what it
    adds (negative: saves), communication included; the exchanges themselves; per device its expected rows,
    its router and expert seconds (forward + backward), and what it holds beyond the TP-split share."""

    forward_s: float
    backward_s: float
    comm_forward_s: float
    comm_backward_s: float
    rows: Mapping[int, float]            # device -> (token, expert) rows it computes
    expert_s: Mapping[int, float]        # device -> its router and experts, forward + backward
    params: Mapping[int, float]          # device -> parameters beyond the TP-split share (per MoE layer)
    activation_bytes: Mapping[int, float]   # device -> saved bytes beyond the TP-split layer's

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


class MoeCosts:
    """MoE prices of a ``CostModel`` (planner/cost.py)."""

    @memo
    def gemms(self, device_type: str, tp: int, micro_batch: int | None = None,
              seq_len: int | None = None) -> MoeGemms:
        """A MoE layer's GEMM blocks on this type at this TP degree and micro-batch shape
        (planner/costmodel/moe_gemms.py): priced by its profile at this model's shapes, or, sleep-mode
        emulated, by its target's."""
        b, s = self._shape(micro_batch, seq_len)
        target = self.sleep_target(device_type)
        if target is not None:
            return target.gemms(self.model.moe, tp, b, s)
        return MoeGemms(self.model.moe, self.model, self.components(device_type, tp, b, s)["mlp"], tp, b, s)

    @memo
    def moe_tp_delta(self, device_type: str, tp: int, micro_batch: int | None = None,
                     seq_len: int | None = None) -> LayerCost:
        """What one MoE layer on a TP-split stage adds to the dense layer: its MLP replaced by the router
        (every rank routes every token), every routed row's expert at width 1/tp and the shared experts."""
        b, s = self._shape(micro_batch, seq_len)
        moe, h, t = self.model.moe, self.model.hidden_size, b * s
        mlp = self.components(device_type, tp, b, s)["mlp"]
        rows = sum(expert_rows(moe, t))
        fwd, bwd = self.gemms(device_type, tp, b, s).tp_delta_s()
        e = self._act_element_bytes(device_type)
        act = (e * (t * h + rows * (h + 4.0 * moe.expert_ffn_size / tp) + 4.0 * t * moe.shared_width / tp)
               + ROUTER_ACT_BYTES * t * moe.num_experts)
        params = (moe.num_experts * h + moe.num_experts * 3 * h * moe.expert_ffn_size // tp
                  + 3 * h * moe.shared_width // tp + (h if moe.shared_gate else 0))
        sp = self.sp_moe_s(device_type, tp, b, s)
        return LayerCost(forward_s=fwd, backward_s=bwd, recompute_s=fwd, tp_forward_s=sp, tp_backward_s=sp,
                         activation_bytes=act - eval_fit(mlp.activation_bytes, b, s), checkpoint_bytes=0.0,
                         params=params - mlp.params)

    def sp_moe_s(self, device_type: str, tp: int, micro_batch: int, seq_len: int) -> float:
        """Under sequence parallelism, what a TP-split MoE layer's collectives add per direction to the dense
        layer's: the block computes on the whole sequence (gathered as the dense MLP's input is) and all-reduces
        its output where the dense MLP reduce-scatters it, one all-gather more (runtime/engine/tensor_parallel.py
        ``_moe_sequence``). 0 without it, and on sleep-mode types (their collectives run inside the blocks)."""
        if not self.sequence_sharded(tp) or self.sleep_target(device_type) is not None:
            return 0.0
        return self._tp_allgather(device_type, tp, self.activation_tensor_bytes(device_type, micro_batch, seq_len))

    @memo
    def ep_reference(self, device_type: str, tp: int, micro_batch: int | None = None,
                     seq_len: int | None = None) -> EpLayer | None:
        """How a multi-device stage of this type and TP degree runs a MoE layer, as the runtime runs it
        (expert-parallel): on the first ``tp`` devices of the type on one node, experts placed by load
        (``lpt_placement``), against TP-split experts; None where no such stage forms (TP 1, no node with
        ``tp`` devices of the type)."""
        if tp == 1:
            return None
        by_node: dict[object, list[int]] = {}
        for d, (t, node) in enumerate(zip(self._type_of, self._node_of)):
            if t == device_type:
                by_node.setdefault(node, []).append(d)
        ref = next((tuple(ds[:tp]) for ds in by_node.values() if len(ds) >= tp), None)
        if ref is None:
            return None
        b, s = self._shape(micro_batch, seq_len)
        rows = expert_rows(self.model.moe, b * s)
        place = lpt_placement(ref, rows, {d: self.expert_row_s(d) for d in ref},
                              dict.fromkeys(ref, self.model.moe.num_experts))
        return self.ep_layer(ref, tuple((d, tuple(place[d])) for d in ref), b, s)

    def search_ep(self, device_type: str, tp: int, micro_batch: int | None = None,
                  seq_len: int | None = None) -> EpLayer | None:
        """``ep_reference`` where it prices faster than TP-split experts (what the planner would choose for
        such a stage), else None: how ``layer`` prices a stage of this type and TP degree."""
        ref = self.ep_reference(device_type, tp, micro_batch, seq_len)
        return ref if ref is not None and ref.time_s < 0 else None

    @memo
    def moe_delta(self, device_type: str, tp: int, micro_batch: int | None = None,
                  seq_len: int | None = None) -> LayerCost:
        """What one MoE layer adds to the dense layer on a stage of this type and TP degree as the search
        prices it: TP-split (``moe_tp_delta``), or expert-parallel as ``ep_reference`` places it where that
        is faster (``search_ep``; the exchanges in the TP fields)."""
        d = self.moe_tp_delta(device_type, tp, micro_batch, seq_len)
        ref = self.search_ep(device_type, tp, micro_batch, seq_len)
        if ref is None:
            return d
        f, b = ref.forward_s - ref.comm_forward_s, ref.backward_s - ref.comm_backward_s
        return dataclasses.replace(d, forward_s=d.forward_s + f, backward_s=d.backward_s + b,
                                   recompute_s=d.recompute_s + ref.forward_s, tp_forward_s=ref.comm_forward_s,
                                   tp_backward_s=ref.comm_backward_s,
                                   activation_bytes=d.activation_bytes + max(ref.activation_bytes.values()))

    def moe_layer(self, dense: LayerCost, device_type: str, tp: int, recompute: bool, micro_batch: int,
                  seq_len: int) -> LayerCost:
        """``dense`` (one dense decoder layer) as the mean layer of this model: MoE layers' share of
        ``moe_delta`` added (a dense model: ``dense`` itself)."""
        if self.model.moe is None:
            return dense
        frac = len(self.model.moe_layers) / self.model.num_layers
        d = self.moe_delta(device_type, tp, micro_batch, seq_len)
        return dataclasses.replace(
            dense, forward_s=dense.forward_s + frac * d.forward_s, backward_s=dense.backward_s + frac * d.backward_s,
            recompute_s=dense.recompute_s + (frac * d.recompute_s if recompute else 0.0),
            tp_forward_s=dense.tp_forward_s + frac * d.tp_forward_s,
            tp_backward_s=dense.tp_backward_s + frac * d.tp_backward_s,
            activation_bytes=dense.activation_bytes + frac * d.activation_bytes,
            params=round(dense.params + frac * d.params))

    def moe_layers_in(self, layers: Sequence[tuple[int, int]]) -> int:
        return sum(1 for a, b in layers for i in range(a, b) if self.model.is_moe_layer(i))

    def moe_placed(self, sc: StageCost, device_type: str, tp: int, layers: tuple[tuple[int, int], ...],
                   recomputed_ids: Collection[int] = ()) -> StageCost:
        """``sc`` (priced with mean layers: ``frac`` of every layer, and of every recomputed one, a MoE layer) for
        the MoE layers the ranges ``layers`` hold, ``recomputed_ids`` of them re-running their forward."""
        moe = self.model.moe
        if moe is None:
            return sc
        n = sum(b - a for a, b in layers)
        frac = len(self.model.moe_layers) / self.model.num_layers
        extra = self.moe_layers_in(layers) - n * frac
        rerun = sum(1 for i in recomputed_ids if self.model.is_moe_layer(i)) - len(recomputed_ids) * frac
        if abs(extra) < 1e-12 and abs(rerun) < 1e-12:
            return sc
        d = self.moe_delta(device_type, tp)
        rerun_s = rerun * d.recompute_s
        return dataclasses.replace(sc, forward_s=sc.forward_s + extra * (d.forward_s + d.tp_forward_s),
                                   backward_s=sc.backward_s + extra * (d.backward_s + d.tp_backward_s) + rerun_s,
                                   compute_s=sc.compute_s + extra * (d.forward_s + d.backward_s) + rerun_s,
                                   tp_forward_s=sc.tp_forward_s + extra * d.tp_forward_s,
                                   tp_backward_s=sc.tp_backward_s + extra * d.tp_backward_s,
                                   params=round(sc.params + extra * d.params))

    def sleep_moe_stage(self, device_type: str, tp: int, num_layers: int, recomputed_layers: int,
                        micro_batch: int, seq_len: int) -> tuple[float, float]:
        """(forward, backward) a sleep-mode type's stage block of ``num_layers`` mean layers adds for its MoE
        layers (``frac`` of them; ``recomputed_layers`` re-running their forward): the target prices a dense
        block, the MoE layers' difference is ``moe_delta`` on the target's shapes (``gemms``)."""
        if self.model.moe is None:
            return 0.0, 0.0
        frac = len(self.model.moe_layers) / self.model.num_layers
        d = self.moe_delta(device_type, tp, micro_batch, seq_len)
        return (num_layers * frac * (d.forward_s + d.tp_forward_s),
                num_layers * frac * (d.backward_s + d.tp_backward_s) + recomputed_layers * frac * d.recompute_s)

    # -- expert-parallel stages ----------------------------------------------------------------------

    def stage_type(self, st: Stage) -> str:
        """The device type a stage's TP parts run at: its own, or on a mixed-type expert-parallel stage the
        slowest member's (a TP collective waits for the slowest rank)."""
        return self._slowest_type(tuple(st.devices))

    def _slowest_type(self, devices: tuple[int, ...]) -> str:
        types = sorted({self._type_of[d] for d in devices})
        if len(types) == 1:
            return types[0]
        tp = len(devices)
        if self.sleeps(devices):   # the emulation's rule (hetu_cli/emulation.py prices its blocks so)
            return slowest_target({t: self.sleep_target(t) for t in types}, tp, self.micro_batch, self.seq_len)
        return max(types, key=lambda t: (self.layer(t, tp).forward_s + self.layer(t, tp).backward_s, t))

    @memo
    def tp_stretch(self, devices: tuple[int, ...]) -> float:
        """How much longer an activation's all-reduce takes over ``devices`` (an expert-parallel stage, which
        may span nodes and mix types) than inside one node of its slowest type, where TP collectives are
        priced: 1 within one node of one type."""
        if len({self._node_of[d] for d in devices}) == 1 and len({self._type_of[d] for d in devices}) == 1:
            return 1.0
        dtype = self._slowest_type(devices)
        act = self.activation_tensor_bytes(dtype)
        inside = self._tp_allreduce(dtype, len(devices), act)
        return max(1.0, self.allreduce_time(devices, act) / inside) if inside > 0 else 1.0

    def ep_priced(self, st: Stage) -> bool:
        """Whether ``st`` is priced as an expert-parallel stage."""
        return st.expert_parallel and self.model.moe is not None

    def sleeps(self, devices: Collection[int]) -> bool:
        """Whether ``devices`` are all sleep-mode emulated: their blocks last their targets' prices, the
        communication inside a block (TP collectives, the expert exchanges) included."""
        return all(self.sleep_target(self._type_of[d]) is not None for d in devices)

    @memo
    def ep_layer(self, devices: tuple[int, ...], experts: tuple, micro_batch: int | None = None,
                 seq_len: int | None = None) -> EpLayer:
        """One MoE layer of the expert-parallel stage ``devices`` holding ``experts`` ((device, experts)
        pairs), against the TP-split layer of its slowest type (``EpLayer``)."""
        b, s = self._shape(micro_batch, seq_len)
        moe, h, t, n = self.model.moe, self.model.hidden_size, b * s, len(devices)
        base = self._slowest_type(devices)
        rows = expert_rows(moe, t)
        got = holder_rows(devices, experts, rows)
        busy_f = busy_b = 0.0
        expert_s, dev_rows, params, act = {}, {}, {}, {}
        for d in devices:
            y = self._type_of[d]
            r = sum(got[d].values())
            fwd, bwd = self.device_expert_s(d, n, r, sum(1 for x in got[d].values() if x > 0), b, s)
            busy_f, busy_b = max(busy_f, fwd), max(busy_b, bwd)
            expert_s[d], dev_rows[d] = fwd + bwd, r
            params[d] = (len(dict(experts).get(d, ())) - moe.num_experts / n) * 3 * h * moe.expert_ffn_size
            e = self._act_element_bytes(y)
            act[d] = (e * (t / n * h + r * (h + 4.0 * moe.expert_ffn_size)) + ROUTER_ACT_BYTES * t / n * moe.num_experts
                      - e * sum(rows) * (h + 4.0 * moe.expert_ffn_size / n) - ROUTER_ACT_BYTES * t * moe.num_experts)
        split_f, split_b = self.gemms(base, n, b, s).routed_tp_s()
        row_bytes = float(h * self._act_element_bytes(base))
        flows = a2a_flows(devices, experts, rows, row_bytes)
        back = tuple(Flow(f.dst, f.src, f.nbytes) for f in flows)
        dispatch = concurrent_seconds(flows, self.transfer_time, self._node_of, self._nic_of)
        combine = concurrent_seconds(back, self.transfer_time, self._node_of, self._nic_of)
        gather = self.allgather_time(devices, t * row_bytes)
        counts = self.allgather_time(devices, n * moe.num_experts * COUNT_BYTES)
        # (under sequence parallelism the TP-split layer's output all-reduce, which expert parallelism skips)
        sp = self.sp_moe_s(base, n, b, s)
        comm_f = counts + dispatch + combine + gather - sp
        comm_b = dispatch + combine + gather - sp
        if self.sleeps(devices):   # inside each device's block, which lasts its target
            comm_f = comm_b = 0.0
        return EpLayer(forward_s=busy_f - split_f + comm_f, backward_s=busy_b - split_b + comm_b,
                       comm_forward_s=comm_f, comm_backward_s=comm_b, rows=dev_rows, expert_s=expert_s,
                       params=params, activation_bytes=act)

    def ep_of(self, st: Stage) -> EpLayer:
        return self.ep_layer(tuple(st.devices), tuple(st.experts or ()))

    def stage_chunk(self, st: Stage, chunk: int) -> tuple[StageCost, ChunkCost]:
        """Chunk ``chunk`` of stage ``st``, one micro-batch: the ``placed_stage`` and ``placed_chunk_cost`` the
        estimate, the plan's op costs and the simulator all price it by, with its MoE layers as the stage runs
        them: ``ep_layer`` on an expert-parallel stage, TP-split experts on one without ``experts`` (where
        ``placed_stage`` priced ``search_ep``)."""
        # (A stage without experts, the planner's hot path: one type, no set built.)
        dtype = self.stage_type(st) if st.expert_parallel else self._type_of[st.devices[0]]
        a, b = st.layers[chunk]
        r = st.chunk_recompute(chunk)
        sc = self.placed_stage(dtype, st.tp, ((a, b),), a == 0, b == self.model.num_layers, recompute_layers=r)
        cc = self.placed_chunk_cost(dtype, st.tp, a, b, recompute_layers=r)
        if self.model.moe is None:
            return sc, cc
        ref = self.search_ep(dtype, st.tp)
        if not self.ep_priced(st):
            if ref is None:
                return sc, cc
            return self._moe_adjusted(sc, cc, st, chunk, -ref.forward_s, -ref.backward_s, -ref.comm_forward_s,
                                      -ref.comm_backward_s)
        ep = self.ep_of(st)
        # A stage across nodes or types: its TP collectives ride its slowest links, not one node's.
        stretch = self.tp_stretch(tuple(st.devices)) - 1.0
        sc = dataclasses.replace(sc, forward_s=sc.forward_s + stretch * sc.tp_forward_s,
                                 backward_s=sc.backward_s + stretch * sc.tp_backward_s,
                                 tp_forward_s=sc.tp_forward_s * (1 + stretch),
                                 tp_backward_s=sc.tp_backward_s * (1 + stretch))
        cc = dataclasses.replace(cc, forward=cc.forward + stretch * sc.tp_forward_s / (1 + stretch),
                                 input_grad=cc.input_grad + stretch * sc.tp_backward_s / (1 + stretch),
                                 full_backward=None if cc.full_backward is None
                                 else cc.full_backward + stretch * sc.tp_backward_s / (1 + stretch))
        if ref is None:   # priced TP-split: the whole of ``ep``
            return self._moe_adjusted(sc, cc, st, chunk, ep.forward_s, ep.backward_s, ep.comm_forward_s,
                                      ep.comm_backward_s)
        return self._moe_adjusted(sc, cc, st, chunk, ep.forward_s - ref.forward_s, ep.backward_s - ref.backward_s,
                                  ep.comm_forward_s - ref.comm_forward_s, ep.comm_backward_s - ref.comm_backward_s)

    def _moe_adjusted(self, sc: StageCost, cc: ChunkCost, st: Stage, chunk: int, fwd: float, bwd: float,
                      comm_f: float, comm_b: float) -> tuple[StageCost, ChunkCost]:
        """``sc`` and ``cc`` of chunk ``chunk`` of ``st`` with each of its MoE layers taking ``fwd`` and ``bwd``
        seconds more (``comm_f``, ``comm_b`` of them exchanges); a recomputed MoE layer reruns its forward."""
        a, b = st.layers[chunk]
        n_moe = self.moe_layers_in(((a, b),))
        # The recomputed layers are the stage's lowest indices (``Stage.chunk_recompute``).
        ids = [i for i in range(a, b)][:st.chunk_recompute(chunk)]
        rc_moe = sum(1 for i in ids if self.model.is_moe_layer(i))
        d_f = n_moe * fwd
        d_b = n_moe * bwd + rc_moe * fwd
        comm_f, comm_b = n_moe * comm_f, n_moe * comm_b + rc_moe * comm_f
        sc = dataclasses.replace(sc, forward_s=sc.forward_s + d_f, backward_s=sc.backward_s + d_b,
                                 compute_s=sc.compute_s + d_f + d_b - comm_f - comm_b,
                                 tp_forward_s=sc.tp_forward_s + comm_f, tp_backward_s=sc.tp_backward_s + comm_b)
        grow = max(1e-6, 1.0 + d_b / (cc.input_grad + cc.weight_grad))
        cc = ChunkCost(forward=max(1e-12, cc.forward + d_f), input_grad=cc.input_grad * grow,
                       weight_grad=cc.weight_grad * grow,
                       full_backward=None if cc.full_backward is None else max(1e-12, cc.full_backward + d_b))
        return sc, cc

    def ep_params(self, st: Stage, device: int) -> float:
        """Parameters ``device`` of stage ``st`` holds beyond the TP-split share (0 off expert parallelism)."""
        if not self.ep_priced(st):
            return 0.0
        return self.moe_layers_in(st.layers) * self.ep_of(st).params[device]

    def ep_device_memory(self, strategy: Strategy, pi: int, k: int, device: int, mem: MemoryBreakdown,
                         schedule: Schedule, zero_degree: int) -> MemoryBreakdown:
        """``mem`` (stage ``k`` of pipeline ``pi`` as ``layer`` prices its layers) for ``device`` of an
        expert-parallel stage: its own experts' parameters, gradients, optimizer states and bf16 copies instead
        of 1/n of every expert, and the rows it receives in each in-flight micro-batch."""
        pipe = strategy.pipelines[pi]
        st = pipe.stages[k]
        if not self.ep_priced(st) or self.target_memory_model(self._type_of[device]) is not None:
            return mem
        ep = self.ep_of(st)
        p = self.ep_params(st, device)
        live = device_limits(schedule, len(pipe.stages), pipe.micro_batches, st.chunks, pipe.activation_limits)[k]
        per_chunk = max(self.moe_layers_in((r,)) for r in st.layers)
        ref = self.search_ep(self.stage_type(st), st.tp)   # what ``layer`` counted
        kept = ep.activation_bytes[device] - (0.0 if ref is None else max(ref.activation_bytes.values()))
        act = 0.0 if st.recompute else live * per_chunk * kept
        m = self.profiles[self._type_of[device]].memory
        return dataclasses.replace(mem, params=mem.params + p * m.param_bytes, grads=mem.grads + p * m.grad_bytes,
                                   optimizer=mem.optimizer + p * m.optimizer_bytes / max(1, zero_degree),
                                   casts=mem.casts + p * m.cast_bytes,
                                   activations=max(0.0, mem.activations + act))

    def stage_expert_sync(self, st: Stage, router: bool = True) -> float:
        """Per step, inside expert-parallel stage ``st``: the gradient all-reduce of every replicated expert
        among its holders and (``router``) of the router, a summand per device (each routes its own slice).
        The placement search's quick price of what the gradient sync lays out from the annotations (a
        replicated expert's and the router's gradients partial over their holders: ``sync_plan``), which
        prices the step."""
        moe, h = self.model.moe, self.model.hidden_size
        n_moe = self.moe_layers_in(st.layers)
        grad = self.profiles[self.stage_type(st)].memory.grad_bytes
        t = self.allreduce_time(st.devices, n_moe * moe.num_experts * h * grad) if router else 0.0
        return t + sum(self.replica_sync_s(st.expert_holders(e), n_moe) for e in range(moe.num_experts))

    def expert_row_s(self, device: int) -> float:
        """Seconds one (token, expert) row costs on ``device``'s type, forward + backward (``MoeGemms.row_s``)."""
        return self.gemms(self._type_of[device], 1).row_s()

    def device_expert_s(self, device: int, n: int, rows: float, experts: int, micro_batch: int | None = None,
                        seq_len: int | None = None) -> tuple[float, float]:
        """(forward, backward) of ``device`` on an expert-parallel stage of ``n`` devices: routing its 1/n of
        the tokens and running ``experts`` experts on ``rows`` rows in all, on its own type."""
        return self.gemms(self._type_of[device], 1, micro_batch, seq_len).device_s(n, rows, experts)

    @memo
    def replica_sync_s(self, holders: tuple[int, ...], layers: int) -> float:
        """Per step, one expert of ``layers`` MoE layers replicated on ``holders``: its gradient all-reduce."""
        if len(holders) < 2:
            return 0.0
        grad = max(self.profiles[self._type_of[d]].memory.grad_bytes for d in holders)
        return self.allreduce_time(holders, layers * 3 * self.model.hidden_size * self.model.moe.expert_ffn_size
                                   * grad)

    def expert_bytes(self, device: int, layers: int, zero_degree: int) -> float:
        """Bytes one whole expert of ``layers`` MoE layers takes on ``device``: parameters, gradients, AdamW
        states (over ``zero_degree``) and bf16 copies."""
        m = self.profiles[self._type_of[device]].memory
        per = m.param_bytes + m.grad_bytes + m.cast_bytes + m.optimizer_bytes / max(1, zero_degree)
        return layers * 3 * self.model.hidden_size * self.model.moe.expert_ffn_size * per

    def ep_summary(self, st: Stage) -> dict:
        """What an expert-parallel stage's report says: per device its experts, expected rows per micro-batch
        (and share of the stage's), and expert seconds per MoE layer; the layer against the TP-split one."""
        ep = self.ep_of(st)
        total = sum(ep.rows.values()) or 1.0
        return {"devices": {d: {"experts": list(st.experts_of(d)), "type": self._type_of[d],
                                "rows": round(ep.rows[d], 1), "load": round(ep.rows[d] / total, 4),
                                "expert_ms": round(1e3 * ep.expert_s[d], 3)} for d in st.devices},
                "vs_tp_split_ms": round(1e3 * ep.time_s, 3), "all_to_all_ms": round(
                    1e3 * (ep.comm_forward_s + ep.comm_backward_s), 3)}


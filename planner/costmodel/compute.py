"""Compute prices: one decoder layer, a stage's extras, a whole stage (measured stage blocks, component
fits, the TP overhead measured or counted), the optimizer step and the step's own code, per device type."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from planner.costmodel.base import (
    BOUNDARY_BYTES,
    TP_ALLREDUCES_PER_LAYER,
    ZERO_FIT,
    LayerCost,
    StageCost,
    memo,
    recomputed,
)
from planner.costmodel.targets import SleepTarget, sleep_target
from runtime.torchfree.profiling.profile import (
    BLOCKS,
    ComponentFit,
    ComputeBlock,
    MeasuredModel,
    component_fits,
    eval_fit,
    extra_components,
    layer_components,
    layer_override_fits,
    measured_tp_comm,
)
from runtime.torchfree.spec.plan import Strategy


def _stage_blocks(blocks: Mapping[str, ComponentFit], first: bool, last: bool) -> list[ComponentFit]:
    """The measured blocks a stage adds beyond its layers: its fixed part, the embedding's, the head's."""
    return [blocks["stage"]] + ([blocks["embedding"]] if first else []) + ([blocks["head"]] if last else [])


class ComputeCosts:
    """Compute prices of a ``CostModel`` (planner/cost.py), which holds the model, cluster, profiles and
    micro-batch shape they read."""

    # -- components ----------------------------------------------------------------------------------

    @memo
    def blocks(self, device_type: str, tp: int) -> dict[str, ComponentFit] | None:
        """Measured stage blocks (one decoder layer, a stage's fixed time, embedding, head) at this TP
        degree, timed through the runtime's stage module; None when the profile has none."""
        measured = self._measured(device_type)
        if measured is not None and tp in measured.blocks and tp not in measured.tables:
            return dict(measured.blocks[tp])
        return None

    @memo
    def components(self, device_type: str, tp: int, micro_batch: int | None = None,
                   seq_len: int | None = None) -> dict[str, ComponentFit]:
        """Per-component fits on this device type at this TP degree: measured if the profile has this
        model shape and TP degree, else derived from the profile's throughput figures; tables (measured
        elsewhere) resolved at this micro-batch shape (runtime/torchfree/profiling/profile.py ``component_fits``)."""
        b, s = self._shape(micro_batch, seq_len)
        return component_fits(self.profiles[device_type], self.model, tp, b, s)

    def _measured(self, device_type: str) -> MeasuredModel | None:
        return self.profiles[device_type].measured_model(self.model)

    def _tp_overhead(self, device_type: str, tp: int) -> ComponentFit | None:
        """The measured per-layer TP overhead (DTensor + collectives), if the profile has it: the layer
        block of ``_tp_blocks``, else (profiles without TP blocks) ``tp_overhead``."""
        blocks = self._tp_blocks(device_type, tp)
        if blocks is not None:
            return blocks["layer"]
        m = self._measured(device_type) if tp > 1 else None
        return None if m is None else m.tp_overhead.get(tp)

    def is_measured(self, device_type: str, tp: int) -> bool:
        m = self._measured(device_type)
        return m is not None and tp in m.tp

    def sequence_sharded(self, tp: int) -> bool:
        """Whether a stage of this TP degree runs sequence parallel: the norms, their saved inputs and the
        residual stream sharded 1/tp along the sequence (runtime/engine/tensor_parallel.py)."""
        return self.sequence_parallel and tp > 1

    def _act_element_bytes(self, device_type: str) -> int:
        return self.profiles[device_type].compute.activation_bytes

    def _shape(self, micro_batch: int | None, seq_len: int | None) -> tuple[int, int]:
        """(micro-batch, sequence length): the given ones, else this model's."""
        return (self.micro_batch if micro_batch is None else micro_batch,
                self.seq_len if seq_len is None else seq_len)

    def activation_tensor_bytes(self, device_type: str, micro_batch: int | None = None,
                                seq_len: int | None = None) -> float:
        """Bytes of one hidden-state tensor [B, s, h]: what crosses a stage boundary or a TP all-reduce."""
        b, s = self._shape(micro_batch, seq_len)
        return float(b * s * self.model.hidden_size * self._act_element_bytes(device_type))

    # -- per layer and per stage ---------------------------------------------------------------------

    @memo
    def layer(self, device_type: str, tp: int, recompute: bool = False, micro_batch: int | None = None,
              seq_len: int | None = None) -> LayerCost:
        """One decoder layer: attention, MLP and two RMSNorms, plus its TP all-reduces."""
        b, s = self._shape(micro_batch, seq_len)
        comp = self.components(device_type, tp, b, s)
        parts = layer_components(comp)
        blocks = self.blocks(device_type, tp)
        timed = [blocks["layer"]] if blocks is not None else parts
        # Sequence parallel: each norm runs on (and saves) 1/tp of the tokens. The blocks' inputs are
        # gathered whole before the column-parallel projections, which save them whole, as without it.
        # (A measured layer block was timed without sequence parallelism and is kept as measured.)
        share = [1.0 / tp if self.sequence_sharded(tp) and p is comp["norm"] else 1.0 for p in parts]
        shares = share if blocks is None else [1.0]
        fwd = sum(k * eval_fit(p.forward_s, b, s) for k, p in zip(shares, timed))
        bwd = sum(k * eval_fit(p.backward_s, b, s) for k, p in zip(shares, timed))
        act = sum(k * eval_fit(p.activation_bytes, b, s) for k, p in zip(share, parts))
        overhead = self._tp_overhead(device_type, tp)
        if overhead is not None:
            tp_f, tp_b = eval_fit(overhead.forward_s, b, s), eval_fit(overhead.backward_s, b, s)
        else:
            # Sequence parallel: each all-reduce becomes an all-gather (before the block) plus a
            # reduce-scatter (after it), the same bytes: priced as the all-reduce.
            ar = self._tp_allreduce(device_type, tp, self.activation_tensor_bytes(device_type, b, s))
            tp_f, tp_b = TP_ALLREDUCES_PER_LAYER[0] * ar, TP_ALLREDUCES_PER_LAYER[1] * ar
        # A recomputed layer keeps its input: the residual stream, 1/tp of it under sequence parallelism.
        kept = float(b * s * self.model.hidden_size * BOUNDARY_BYTES) / (tp if self.sequence_sharded(tp) else 1)
        dense = LayerCost(forward_s=fwd, backward_s=bwd, recompute_s=fwd + tp_f if recompute else 0.0,
                          tp_forward_s=tp_f, tp_backward_s=tp_b, activation_bytes=act,
                          checkpoint_bytes=kept,
                          params=sum(p.params for p in parts))
        return self.moe_layer(dense, device_type, tp, recompute, b, s)   # MoE layers: planner/costmodel/moe.py

    @memo
    def extras(self, device_type: str, tp: int, first: bool, last: bool, micro_batch: int | None = None,
               seq_len: int | None = None) -> LayerCost:
        """What a stage adds to its layers: the first stage's embedding, the last one's final norm, head
        and loss, and (measured stage blocks only) every stage's fixed time per micro-batch."""
        b, s = self._shape(micro_batch, seq_len)
        comp = self.components(device_type, tp, b, s)
        parts = extra_components(comp, first, last)
        blocks = self.blocks(device_type, tp)
        # Measured blocks: a stage's fixed time per micro-batch (every stage pays it) plus what the
        # embedding and the head add; else the components' sum. (The embedding, the final norm and the
        # head run as without sequence parallelism: it shards only between the first and the last layer.)
        timed = parts if blocks is None else _stage_blocks(blocks, first, last)
        tp_blocks = self._tp_blocks(device_type, tp)
        if tp_blocks is not None:   # measured: DTensor dispatch and collectives of the TP stage module
            tp_f, tp_b = self._tp_extras(tp_blocks, first, last, b, s)
        else:   # counted: the embedding's all-reduce, the head's all-gather and input-gradient all-reduce
            act = self.activation_tensor_bytes(device_type, b, s)
            ar_act = self._tp_allreduce(device_type, tp, act)
            logits = float(b * s * self.model.vocab_size * self._act_element_bytes(device_type))
            tp_f = (ar_act if first else 0.0) + (self._tp_allgather(device_type, tp, logits) if last else 0.0)
            tp_b = ar_act if last else 0.0
            if self.sequence_sharded(tp):
                # The last layer's output gathered whole (forward); the first layer's input scattered, so
                # its gradient gathered whole (backward): runtime/engine/tensor_parallel.py.
                ag = self._tp_allgather(device_type, tp, act)
                tp_f, tp_b = tp_f + ag, tp_b + ag
        return LayerCost(
            forward_s=sum(eval_fit(p.forward_s, b, s) for p in timed),
            backward_s=sum(eval_fit(p.backward_s, b, s) for p in timed),
            recompute_s=0.0, tp_forward_s=tp_f, tp_backward_s=tp_b,
            activation_bytes=sum(eval_fit(p.activation_bytes, b, s) for p in parts),
            checkpoint_bytes=0.0, params=sum(p.params for p in parts))

    @memo
    def stage(self, device_type: str, tp: int, num_layers: int, first: bool, last: bool,
              recompute: bool = False, micro_batch: int | None = None, seq_len: int | None = None,
              recompute_layers: int = 0) -> StageCost:
        """One micro-batch through a stage of ``num_layers`` layers, ``recomputed(...)`` of them with
        whole-layer checkpoints (their forward re-run in the backward)."""
        r = recomputed(num_layers, recompute, recompute_layers)
        lay = self.layer(device_type, tp, r > 0, micro_batch, seq_len)
        ext = self.extras(device_type, tp, first, last, micro_batch, seq_len)
        n = num_layers
        b, s = self._shape(micro_batch, seq_len)
        target = self.sleep_target(device_type)
        if target is not None:   # sleep mode: each block lasts its target (TP collectives run inside it)
            block = ComputeBlock(layers=n, micro_batch=b, seq_len=s, backward=False, tp=tp, recompute=r == n > 0,
                                 first=first, last=last)
            moe_f, moe_b = self.sleep_moe_stage(device_type, tp, n, r, b, s)
            fwd = target.block_s(block) + moe_f
            bwd = target.block_s(dataclasses.replace(block, backward=True)) + moe_b
            return StageCost(forward_s=fwd, backward_s=bwd, compute_s=fwd + bwd, tp_forward_s=0.0,
                             tp_backward_s=0.0, params=n * lay.params + ext.params)
        fwd_c = n * lay.forward_s + ext.forward_s
        bwd_c = n * lay.backward_s + r * lay.recompute_s + ext.backward_s
        tp_f = n * lay.tp_forward_s + ext.tp_forward_s
        tp_b = n * lay.tp_backward_s + ext.tp_backward_s
        return StageCost(forward_s=fwd_c + tp_f, backward_s=bwd_c + tp_b, compute_s=fwd_c + bwd_c,
                         tp_forward_s=tp_f, tp_backward_s=tp_b, params=n * lay.params + ext.params)

    @memo
    def placed_stage(self, device_type: str, tp: int, layers: tuple[tuple[int, int], ...], first: bool, last: bool,
                     recompute: bool = False, recompute_layers: int = 0) -> StageCost:
        """``stage`` for the decoder layer ranges ``layers`` ((start, stop) per chunk): where the profile
        overrides some of them by index (``MeasuredModel.layers``), their own components' times replace the
        shared layer's. The recomputed layers are the lowest ``recomputed(...)`` indices."""
        n_layers = sum(b - a for a, b in layers)
        rc_ids = set(sorted(i for a, b in layers for i in range(a, b))[:recomputed(n_layers, recompute,
                                                                                   recompute_layers)])
        sc = self.moe_placed(self.stage(device_type, tp, n_layers, first, last, recompute,
                                        recompute_layers=recompute_layers), device_type, tp, layers, rc_ids)
        prof, (b, s) = self.profiles[device_type], self._shape(None, None)
        measured = self._measured(device_type)
        if measured is None or not measured.layers or self.sleep_target(device_type) is not None:
            return sc
        base = layer_components(self.components(device_type, tp))
        d_f = d_b = 0.0
        for i in (i for a, b in layers for i in range(a, b)):
            own = layer_override_fits(prof, self.model, tp, i, b, s)
            if own is None:
                continue
            f = sum(eval_fit(p.forward_s, b, s) for p in layer_components(own)) - sum(
                eval_fit(p.forward_s, b, s) for p in base)
            d_f += f
            d_b += f * (i in rc_ids) + sum(eval_fit(p.backward_s, b, s) for p in layer_components(own)) - sum(
                eval_fit(p.backward_s, b, s) for p in base)
        return dataclasses.replace(sc, forward_s=sc.forward_s + d_f, backward_s=sc.backward_s + d_b,
                                   compute_s=sc.compute_s + d_f + d_b)

    def _tp_blocks(self, device_type: str, tp: int) -> Mapping[str, ComponentFit] | None:
        """Measured TP overhead per stage block, if the profile has it: for a
        sequence-parallel plan the figures measured with it on (``tp_blocks_sp``), where the profile has
        them at this degree, else (older profiles) those measured without it, whose collectives move the
        same bytes (each all-reduce a reduce-scatter plus an all-gather)."""
        m = self._measured(device_type) if tp > 1 else None
        if m is not None and measured_tp_comm(self.profiles[device_type], self.model, tp):
            return dict.fromkeys(BLOCKS, ZERO_FIT)   # the measured times include the collectives
        if m is not None and self.sequence_sharded(tp) and tp in m.tp_blocks_sp:
            return m.tp_blocks_sp.get(tp)
        return None if m is None else m.tp_blocks.get(tp)

    @staticmethod
    def _tp_extras(blocks: Mapping[str, ComponentFit], first: bool, last: bool, b: int, s: int) -> tuple[float, float]:
        """(forward, backward) TP overhead a stage adds beyond its layers: its fixed part, the embedding's
        and the head's."""
        parts = _stage_blocks(blocks, first, last)
        return (sum(eval_fit(p.forward_s, b, s) for p in parts), sum(eval_fit(p.backward_s, b, s) for p in parts))

    @memo
    def sleep_target(self, device_type: str) -> SleepTarget | None:
        """A sleep-mode emulated type's target (runtime/torchfree/spec/cluster.py ``Emulation``): its forward and
        backward blocks last what the target prices them at (``stage``), the same function the runtime's
        emulation sleeps by. None for every other type."""
        em = self.cluster.device_types[device_type].emulate
        if em is None or not em.sleeps:
            return None
        return sleep_target(em, trained=self.model, file=f"cluster {self.cluster.name}",
                            field=f"device_types.{device_type}.emulate")

    # -- optimizer -----------------------------------------------------------------------------------

    def optimizer_time(self, device_type: str, params: float, zero_degree: int = 1, tensors: int = 0) -> float:
        """One AdamW step over ``params`` local parameters in ``tensors`` tensors (``params / zero_degree``
        with ZeRO-1)."""
        opt = self.profiles[device_type].optimizer
        return opt.seconds_per_param * params / max(1, zero_degree) + opt.seconds_per_tensor * tensors + opt.fixed_s

    def step_overhead_time(self, device_type: str, params: float, tensors: int = 0) -> float:
        """A step's own code outside its compute and comm spans on one device (gradients collected and
        reset, the global norm summed tensor by tensor): measured profiles only, never stretched."""
        fit = self.profiles[device_type].step_overhead
        return fit.seconds_per_param * params + fit.seconds_per_tensor * tensors + fit.fixed_s

    def step_overhead_times(self, strategy: Strategy) -> dict[int, float]:
        return {d: self.step_overhead_time(self._type_of[d], n, tensors)
                for d, (n, tensors) in self.device_params(strategy).items()}

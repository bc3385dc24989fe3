"""Memory prices: a stage's parameters, gradients, optimizer states and activations, per device and per
pipeline as its schedule keeps micro-batches in flight."""

from __future__ import annotations

import dataclasses
from typing import Self

from planner.costmodel.base import GIB, MemoryBreakdown, memo, recomputed, stage_recompute, zero_degree
from runtime.torchfree.profiling.profile import (
    eval_fit,
)
from runtime.torchfree.schedule_policies import device_limits
from runtime.torchfree.spec.plan import Schedule, Strategy


class MemoryCosts:
    """Memory prices of a ``CostModel`` (planner/cost.py)."""

    # -- memory --------------------------------------------------------------------------------------

    @memo
    def stage_memory(self, device_type: str, tp: int, num_layers: int, first: bool, last: bool,
                     recompute: bool, in_flight: int, zero_degree: int = 1,
                     recompute_layers: int = 0) -> MemoryBreakdown:
        """Peak bytes on one device of a stage holding ``in_flight`` micro-batches of activations.

        A layer without recompute keeps its saved tensors per in-flight micro-batch; a recomputed one
        (``recomputed(...)`` of them) only its input, and while one is recomputed its full activations
        live once more.
        The head's logits live only between the last stage's forward and backward of one micro-batch.
        A sleep-mode type that emulates its target's memory is priced by ``target_memory_model``.
        """
        target = self.target_memory_model(device_type)
        if target is not None:
            return target.stage_memory(device_type, tp, num_layers, first, last, recompute, in_flight, zero_degree,
                                       recompute_layers)
        prof = self.profiles[device_type]
        mem = prof.memory
        r = recomputed(num_layers, recompute, recompute_layers)
        lay = self.layer(device_type, tp, r > 0)
        ext = self.extras(device_type, tp, first, last)
        params = num_layers * lay.params + ext.params
        act = in_flight * ((num_layers - r) * lay.activation_bytes + r * lay.checkpoint_bytes)
        if r:
            act += lay.activation_bytes
        comp = self.components(device_type, tp)
        if first:
            act += in_flight * eval_fit(comp["embedding"].activation_bytes, self.micro_batch, self.seq_len)
        if last:
            act += sum(eval_fit(comp[k].activation_bytes, self.micro_batch, self.seq_len) for k in ("norm", "head"))
        # Autocast's bf16 copies of the matrices a step multiplies with (the layers' and the head's; the
        # embedding is a lookup, the norms stay fp32), made once per step and shared by its micro-batches.
        cast = (num_layers * lay.params + (comp["head"].params if last else 0.0)) * mem.cast_bytes
        return MemoryBreakdown(params=params * mem.param_bytes, grads=params * mem.grad_bytes,
                               optimizer=params * mem.optimizer_bytes / max(1, zero_degree),
                               activations=act, overhead=mem.framework_overhead_gib * GIB, casts=cast)

    @memo
    def target_memory_model(self, device_type: str) -> Self | None:
        """For a sleep-mode type with ``memory: target`` (runtime/torchfree/spec/cluster.py ``Emulation``): a cost model
        of the target's model on its profile at ``seq_scale`` times this one's lengths, with the type's
        emulation removed, whose memory is this type's; None for every other type."""
        target = self.sleep_target(device_type)
        if target is None or not target.memory:
            return None
        dt = self.cluster.device_types[device_type]
        types = {**self.cluster.device_types, device_type: dataclasses.replace(dt, emulate=None)}
        profiles = {t: target.profile if t == device_type else self.profiles[t] for t in types}
        return type(self)(target.model, dataclasses.replace(self.cluster, device_types=types), profiles,
                         micro_batch=self.micro_batch, seq_len=self.seq_len * target.seq_scale,
                         step_allreduce=self.step_allreduce, sequence_parallel=self.sequence_parallel)

    def capacity_bytes(self, device: int) -> float:
        return self.cluster.type_of(device).memory_gib * GIB

    # -- memory of chunks, devices and pipelines ---------------------------------------------------

    @memo
    def chunk_activation_bytes(self, device_type: str, tp: int, num_layers: int, first: bool,
                               recompute: bool, recompute_layers: int = 0) -> float:
        """Bytes one micro-batch's activation of a chunk keeps until its backward (W under a split
        backward): each layer's saved tensors (only its input where it recomputes), and the embedding's."""
        target = self.target_memory_model(device_type)
        if target is not None:
            return target.chunk_activation_bytes(device_type, tp, num_layers, first, recompute, recompute_layers)
        r = recomputed(num_layers, recompute, recompute_layers)
        lay = self.layer(device_type, tp, r > 0)
        act = (num_layers - r) * lay.activation_bytes + r * lay.checkpoint_bytes
        if first:
            act += eval_fit(self.components(device_type, tp)["embedding"].activation_bytes, self.micro_batch,
                            self.seq_len)
        return act

    @memo
    def device_memory(self, device_type: str, tp: int, chunks: tuple[tuple[int, bool, bool], ...],
                      recompute: bool, live_chunks: int, zero_degree: int = 1,
                      recompute_layers: tuple[int, ...] | None = None) -> MemoryBreakdown:
        """Peak bytes on one device of a stage holding ``chunks`` ((layers, first, last) each) with at most
        ``live_chunks`` chunk activations alive (``live_activation_limit``): each counted at the largest
        chunk's size, so it bounds any order the scheduler picks. One chunk is ``stage_memory``.
        ``recompute_layers``: per chunk, how many of its layers recompute (``Stage.chunk_recompute``)."""
        base, per = self._memory_parts(device_type, tp, chunks, recompute, zero_degree, recompute_layers)
        return dataclasses.replace(base, activations=base.activations + live_chunks * per)

    def device_memory_total(self, device_type: str, tp: int, chunks: tuple[tuple[int, bool, bool], ...],
                            recompute: bool, live_chunks: int, zero_degree: int = 1,
                            recompute_layers: tuple[int, ...] | None = None) -> float:
        """``device_memory(...).total``, the same float, without building the breakdown: the layer split's
        memory tables (planner/layer_split.py) ask it for every layer count at every activation bound."""
        base, per = self._memory_parts(device_type, tp, chunks, recompute, zero_degree, recompute_layers)
        return base.total_with(base.activations + live_chunks * per)

    @memo
    def _memory_parts(self, device_type: str, tp: int, chunks: tuple[tuple[int, bool, bool], ...],
                      recompute: bool, zero_degree: int, recompute_layers: tuple[int, ...] | None
                      ) -> tuple[MemoryBreakdown, float]:
        """``device_memory`` without its live activations, and the bytes of one (the largest chunk's): the
        part shared by every activation bound."""
        # Written out (no generator per sum, any and max: the layer split's tables call this 140 000 times at
        # 64 GPUs); the same sums, truth values and first largest value.
        n, first, last = 0, False, False
        for k, f, la in chunks:
            n += k
            if f:
                first = True
            if la:
                last = True
        rc = recompute_layers if recompute_layers is not None else (0,) * len(chunks)
        base = self.stage_memory(device_type, tp, n, first, last, recompute, 0, zero_degree, sum(rc))
        per = None
        for (k, f, _), r in zip(chunks, rc):
            b = self.chunk_activation_bytes(device_type, tp, k, f, recompute, r)
            if per is None or b > per:
                per = b
        if per is None:
            raise ValueError("max() arg is an empty sequence")   # (as max raised: no chunks)
        return base, per

    def pipeline_memory(self, strategy: Strategy, pi: int, schedule: Schedule, zero_degree: int = 1
                        ) -> list[MemoryBreakdown]:
        """``device_memory`` of each stage of pipeline ``pi`` under ``schedule``: its documented bound, or the
        pipeline's raised ``activation_limits`` (``device_limits``: the bound its lists are built under)."""
        pipe = strategy.pipelines[pi]
        n_layers, n = self.model.num_layers, len(pipe.stages)
        limits = device_limits(schedule, n, pipe.micro_batches, pipe.stages[0].chunks, pipe.activation_limits)
        out = []
        for k, st in enumerate(pipe.stages):
            live = limits[k]
            chunks = tuple((b - a, a == 0, b == n_layers) for a, b in st.layers)
            out.append(self.device_memory(self._type_of[st.devices[0]], st.tp, chunks, st.recompute, live,
                                          zero_degree, stage_recompute(st)))
        return out

    def strategy_memory(self, strategy: Strategy, schedule: Schedule = "1f1b",
                        zero: int = 0) -> dict[int, MemoryBreakdown]:
        """Peak memory of every device the strategy uses (ZeRO-1 shards over the pipelines), each pipeline
        under its own schedule's activation bound (``pipeline_memory``)."""
        zd = zero_degree(len(strategy.pipelines), zero)
        out = {}
        for pi, pipe in enumerate(strategy.pipelines):
            name = pipe.schedule if pipe.schedule is not None else schedule
            for k, (s, mem) in enumerate(zip(pipe.stages, self.pipeline_memory(strategy, pi, name, zd))):
                for d in s.devices:
                    out[d] = self.ep_device_memory(strategy, pi, k, d, mem, name, zd)
        return out

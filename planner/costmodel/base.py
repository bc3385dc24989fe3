"""What the cost model's parts share: its result records, the per-instance cache of its methods, the
constants of the runtime's layout it prices, and small pure formulas (recompute counts, ZeRO copies, model
FLOPs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.torchfree.engine.specialize import BOUNDARY_DTYPE
from runtime.torchfree.profiling.profile import (
    ComponentFit,
)
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Schedule, Stage, Strategy, TrainingSettings

GIB = float(2**30)

# Collectives a TP group issues per micro-batch, as the runtime lays TP out with DTensor
# (runtime/engine/tensor_parallel.py; Megatron layout): in forward, the two
# row-parallel projections (o_proj, down_proj) all-reduce their outputs; in backward, each block's
# column-parallel projections (q/k/v, gate/up) read one shared replicated input, so their partial input
# gradients add up locally and one all-reduce per block remains (counted with DTensor's CommDebugMode:
# 2 forward + 2 backward per layer). The vocab-parallel
# embedding all-reduces its output; the column-parallel head all-gathers the logits (forward) and
# all-reduces its input gradient (backward). Under sequence parallelism (``training.sequence_parallel``)
# each layer's all-reduces are a reduce-scatter plus an all-gather of the same bytes, and a stage adds
# one all-gather each way where its sharded residual stream meets its replicated ends (``extras``).
TP_ALLREDUCES_PER_LAYER = (2, 2)
# What crosses a stage boundary: the runtime's residual stream, in its dtype.
BOUNDARY_BYTES = BOUNDARY_DTYPE.itemsize
# What a TP degree adds where the measured times already include its collectives (``includes_tp_comm``).
ZERO_FIT = ComponentFit((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), params=0)


def recomputed(num_layers: int, recompute: bool, recompute_layers: int) -> int:
    """How many of ``num_layers`` layers recompute: all with ``recompute``, else ``recompute_layers``
    (partial recompute, ``Stage.recompute_layers``), at most all."""
    return num_layers if recompute else min(num_layers, max(0, recompute_layers))


def stage_recompute(st: Stage) -> tuple[int, ...]:
    """Per chunk of ``st``, how many of its layers recompute (``Stage.chunk_recompute``)."""
    return tuple(st.chunk_recompute(c) for c in range(st.chunks))


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recompute): ``6N + 12*L*h*s`` (PaLM, App. B),
    with N the layer and head parameters a token passes through (the embedding lookup is not a matmul; a
    MoE layer counts its top-k experts)."""
    layers = model.num_layers * model.layer_params() if model.moe is None else \
        sum(model.active_layer_params(i) for i in range(model.num_layers))
    n = layers + model.vocab_size * model.hidden_size
    return 6.0 * n + 12.0 * model.num_layers * model.hidden_size * seq_len


def model_flops_utilization(model: ModelSpec, cluster: Any, devices: Iterable[int], seq_len: int, tokens: int,
                            step_time_s: float) -> float:
    """MFU: the model FLOPs of a step of ``tokens`` tokens (``model_flops_per_token`` at ``seq_len``) per
    second, over the sum of ``devices``' dense bf16 datasheet peaks (docs/training.md)."""
    peak = sum(cluster.type_of(d).peak_bf16_tflops for d in devices) * 1e12
    flops = model_flops_per_token(model, seq_len) * tokens
    return flops / step_time_s / peak if step_time_s > 0 and peak > 0 else 0.0


def has_tp_stage(strategy: Strategy) -> bool:
    """Whether some stage is a TP group: what ``training.sequence_parallel`` acts on (a plan without one
    must not set it, runtime/torchfree/spec/validate.py)."""
    return any(st.tp > 1 for p in strategy.pipelines for st in p.stages)


def zero_degree(pipelines: int, zero: int) -> int:
    """How many ways ZeRO-1 divides a device's optimizer state and AdamW step (``zero``: the copy count,
    0 off): ``pipelines // r`` chunks per slice (runtime/torchfree/engine/zero.py ``place``; a slice has at least
    one replica per pipeline, so this errs on the side of memory)."""
    return max(1, pipelines // int(zero)) if zero else 1


def zero_copies(training: TrainingSettings) -> int:
    """A plan's ZeRO-1 setting as the copy count the cost model takes (0: off)."""
    return training.zero_redundancy if training.zero else 0


def zero_fields(copies: int) -> dict[str, Any]:
    """The inverse of ``zero_copies``: ``TrainingSettings``' ZeRO-1 fields for a copy count."""
    return {"zero": bool(copies), "zero_redundancy": max(1, int(copies))}


# ---------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class LayerCost:
    """One micro-batch through one decoder layer (or the first/last stage's extras), one device.

    ``forward_s``/``backward_s``: compute only. ``recompute_s``: the forward re-run in backward when
    the stage recomputes. ``tp_forward_s``/``tp_backward_s``: the TP collectives. ``activation_bytes``:
    saved for backward; ``checkpoint_bytes``: what recompute keeps instead (the layer input).
    ``params``: local (per shard) parameter count.
    """

    forward_s: float
    backward_s: float
    recompute_s: float
    tp_forward_s: float
    tp_backward_s: float
    activation_bytes: float
    checkpoint_bytes: float
    params: int


@dataclass(frozen=True)
class StageCost:
    """One micro-batch through one stage. Times include the TP collectives (listed separately too)."""

    forward_s: float
    backward_s: float
    compute_s: float        # forward + backward (+ recompute) compute, no communication
    tp_forward_s: float     # TP collectives inside forward_s
    tp_backward_s: float    # TP collectives inside backward_s (recompute included)
    params: int             # local parameters on each device of the stage

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def tp_comm_s(self) -> float:
        return self.tp_forward_s + self.tp_backward_s


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at its peak."""

    params: float
    grads: float
    optimizer: float
    activations: float
    overhead: float
    casts: float = 0.0   # bf16 weight copies for one step's compute (freed after it, like the gradients)

    @property
    def total(self) -> float:
        return self.total_with(self.activations)

    def total_with(self, activations: float) -> float:
        """``total`` had the activations been ``activations`` (the same sum, in the same order)."""
        return self.params + self.grads + self.optimizer + activations + self.overhead + self.casts

    @property
    def gib(self) -> float:
        return self.total / GIB


@dataclass(frozen=True)
class PipelineEstimate:
    micro_batches: int
    stages: tuple[StageCost, ...]
    boundary_s: tuple[float, ...]   # per boundary: forward activation + backward gradient, one micro-batch
    time_s: float
    schedule: Schedule = "1f1b"     # the schedule it is priced (and runs) with
    chunks: int = 1                 # model chunks per stage (v)


@dataclass(frozen=True)
class StrategyEstimate:
    step_time_s: float
    pipelines: tuple[PipelineEstimate, ...]
    grad_sync_s: float
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    memory: Mapping[int, MemoryBreakdown]   # by device id
    capacity_gib: Mapping[int, float]
    oom_devices: tuple[int, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.oom_devices


# ---------------------------------------------------------------------------------------------------


_KEYWORDS = object()   # marks a ``memo`` key with keyword arguments: no positional tuple can hold it


def memo(fn: Callable) -> Callable:
    """Per-instance cache for methods with hashable arguments (CostModel holds unhashable specs)."""
    name = f"_memo_{fn.__name__}"

    def wrapper(self, *args, **kwargs):
        # The search calls these millions of times (3.0 M calls at 64 GPUs, most hits): a positional call is
        # keyed by its argument tuple itself (no key tuple built and hashed around it), and the cache found
        # by one dict lookup once it exists.
        key = (args, _KEYWORDS, tuple(sorted(kwargs.items()))) if kwargs else args
        try:
            cache = self.__dict__[name]
        except KeyError:
            cache = self.__dict__[name] = {}
        try:
            return cache[key]
        except KeyError:
            value = cache[key] = fn(self, *args, **kwargs)
            return value

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper

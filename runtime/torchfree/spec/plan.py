"""Plan spec (plan.yaml): training settings plus one or more named heterogeneous strategies.

A strategy is a list of pipelines; each pipeline has its own micro-batch count, schedule and a chain
of stages; each stage is a TP group (its devices) holding one contiguous range of decoder layers per
model chunk (several under interleaved 1F1B and ZB-V: docs/schedules.md). The chunk holding layer 0
also holds the embedding, the chunk holding the last layer the final norm and head. Optional op costs
(``Stage.op_costs``, ``Pipeline.transfer_costs``) order the pipeline's action lists (docs/schedules.md,
"Costs in the plan").
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.torchfree.errors import Checker, Problem, SpecError, listed
from runtime.torchfree.schedule_policies import ScheduleName
from runtime.torchfree.spec.moe import MAX_EXPERTS

PLAN_VERSION = 1
# Bounds on what a (hostile) file or request makes every verb enumerate: schedules list each micro-batch and
# documents runs draw each document of a step. BERT's LAMB runs used 65,536 sequences per step; Llama 3 16M
# tokens per step.
MAX_GLOBAL_BATCH = 65_536
MAX_TOKENS_PER_STEP = 1 << 26
# Warmup and decay lengths, in updates (Llama 3 405B: 1.2M steps); more is a typo or a hostile file.
MAX_SCHEDULE_STEPS = 100_000_000

Schedule = ScheduleName  # the plan's name for it (the planner imports it from here)


LrDecay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW's settings and its learning-rate schedule (``lr_at``).

    The schedule is Megatron's and torchtitan's usual shape: a linear warmup over ``warmup_steps`` updates,
    then ``decay`` from ``lr`` to ``min_lr`` over ``decay_steps`` updates, then ``min_lr``. It is a function
    of the update's index alone, which every device, the reference, a resumed checkpoint and an elastic
    switch already agree on (AdamW's bias correction counts the same steps), so it needs no state of its own.
    """

    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # Omitted where default: plans without a schedule read and write as before (a constant ``lr``).
    warmup_steps: int = field(default=0, metadata={"omit_default": True})
    decay: LrDecay = field(default="constant", metadata={"omit_default": True})
    decay_steps: int = field(default=0, metadata={"omit_default": True})
    min_lr: float = field(default=0.0, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.lr > 0, "lr", "must be positive")
            c.check(self.weight_decay >= 0, "weight_decay", "must not be negative")
            c.check(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)")
            c.check(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)")
            c.check(self.eps > 0, "eps", "must be positive")
            c.check(self.grad_clip >= 0, "grad_clip", "must not be negative (0 disables clipping)")
            c.check(0 <= self.warmup_steps <= MAX_SCHEDULE_STEPS, "warmup_steps",
                    f"must be in [0, {MAX_SCHEDULE_STEPS:,}], got {self.warmup_steps}")
            c.check(0 <= self.decay_steps <= MAX_SCHEDULE_STEPS, "decay_steps",
                    f"must be in [0, {MAX_SCHEDULE_STEPS:,}], got {self.decay_steps}")
            c.check(self.decay == "constant" or self.decay_steps >= 1, "decay_steps",
                    f"decay {self.decay!r} needs decay_steps >= 1 (the updates over which lr falls to min_lr)")
            c.check(self.decay != "constant" or (self.decay_steps == 0 and self.min_lr == 0), "decay",
                    "is constant, so decay_steps and min_lr mean nothing: set decay to linear or cosine")
            c.check(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr = {self.lr:g}], got {self.min_lr:g}")

    def schedule_text(self) -> str:
        """The schedule in words (``hspmd show``)."""
        text = f"lr {self.lr:g}"
        if self.warmup_steps:
            text += f" after a {self.warmup_steps}-step warmup"
        if self.decay != "constant":
            text += f", {self.decay} decay to {self.min_lr:g} over {self.decay_steps} steps"
        return text

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step`` (0: the first): ``lr * (step + 1) / warmup_steps`` while
        warming up (the last warmup update at ``lr``), then the decay from ``lr`` (at its start) towards
        ``min_lr`` (reached after ``decay_steps`` updates, and kept)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        left = 1.0 - done if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.min_lr + (self.lr - self.min_lr) * left


@dataclass(frozen=True)
class TrainingSettings:
    global_batch: int
    micro_batch: int
    seq_len: int
    zero: bool = False
    # ZeRO-1's copies of each moment chunk (runtime/torchfree/engine/zero.py): 1 is plain ZeRO-1; r >= 2 survives the
    # loss of r - 1 holders of a chunk (elastic runs), for r/k of the moments per device instead of 1/k.
    zero_redundancy: int = 1
    schedule: ScheduleName = "1f1b"  # the default of every pipeline (Pipeline.schedule overrides it)
    seed: int = 0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    # Documents mode (docs/lengths.md): a step is whole documents filling this many tokens, seq_len the longest
    # document. None: the fixed global_batch x seq_len windows.
    tokens_per_step: int | None = None
    # Megatron sequence parallelism on every TP stage (runtime/engine/tensor_parallel.py): the residual
    # stream, the norms and their saved inputs sharded along the sequence, each TP all-reduce a reduce-
    # scatter plus an all-gather. Plan-wide, as the cost model prices a (device type, TP degree).
    sequence_parallel: bool = field(default=False, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("global_batch", "micro_batch", "seq_len", "zero_redundancy"), lambda v: v >= 1,
                   "must be at least 1")
            c.check(self.zero or self.zero_redundancy == 1, "zero_redundancy",
                    f"{self.zero_redundancy} copies of ZeRO-1's moment chunks need zero: true")
            c.check(self.global_batch <= MAX_GLOBAL_BATCH, "global_batch",
                    f"{self.global_batch:,} sequences per step: hspmd plans for at most {MAX_GLOBAL_BATCH:,}")
            c.check(self.tokens_per_step is None or self.tokens_per_step >= 1, "tokens_per_step",
                    f"must be at least 1, got {self.tokens_per_step}")
            if self.tokens_per_step is not None and self.tokens_per_step > MAX_TOKENS_PER_STEP:
                c.add("tokens_per_step", f"{self.tokens_per_step:,} tokens per step: hspmd plans for at most "
                                         f"{MAX_TOKENS_PER_STEP:,}")
            c.check(isinstance(self.sequence_parallel, bool), "sequence_parallel",
                    f"must be true or false, got {self.sequence_parallel!r}")


LayerRange = tuple[int, int]
OpCosts = tuple[float, float, float]   # one chunk's (forward, input_grad, weight_grad) seconds per micro-batch


def _layer_ranges(layers: object) -> tuple[LayerRange, ...]:
    """A single ``(start, stop)`` pair is the one-chunk form of ``((start, stop),)``."""
    if isinstance(layers, (tuple, list)) and len(layers) == 2 and all(isinstance(x, int) for x in layers):
        return (tuple(layers),)  # type: ignore[return-value]
    return tuple(tuple(r) for r in layers)  # type: ignore[union-attr, misc]


def op_cost_problems(op_costs: tuple[tuple[float, ...], ...], chunks: int) -> list[str]:
    """What is wrong with a stage's ``op_costs`` for ``chunks`` chunks, one message each (empty: fine)."""
    if len(op_costs) != chunks:
        return [f"lists {len(op_costs)} cost triple(s) for {chunks} chunk(s): one [forward, input_grad, "
                f"weight_grad] per layer range"]
    out = []
    for k, triple in enumerate(op_costs):
        if len(triple) != 3:
            out.append(f"chunk {k}: expected [forward, input_grad, weight_grad], got {list(triple)}")
        elif not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in triple):
            out.append(f"chunk {k}: op durations must be positive finite seconds, got {list(triple)}")
    return out


def expert_destination(holders: Sequence[int], source: int) -> int:
    """Which of an expert's holders gets the expert's tokens of token slice ``source``: a replicated expert's
    holders share the senders, slice s going to holder s mod m. The runtime's token exchange and the
    planner's price of it both read the rule here (docs/moe.md)."""
    return holders[source % len(holders)]


def _placement_pairs(devices: tuple[int, ...], experts: Mapping) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``{device: [expert, ...]}`` as (device, experts) pairs: the stage's devices first in their order, then
    any key that is not one of them (left for validation to name). Counts, ``{device: n, ...}``, give the
    devices consecutive experts in that order (``{4: 3, 5: 1}``: device 4 experts 0-2, device 5 expert 3)."""
    def key(d: object) -> tuple[int, object]:
        return (devices.index(d), 0) if d in devices else (len(devices), str(d))

    order = sorted(experts, key=key)
    if experts and all(_is_count(v) and 0 <= v <= MAX_EXPERTS for v in experts.values()):
        starts = itertools.accumulate((experts[d] for d in order), initial=0)
        return tuple((d, tuple(range(a, a + experts[d]))) for d, a in zip(order, starts))
    return tuple((d, tuple(experts[d]) if isinstance(experts[d], (list, tuple)) else experts[d])  # type: ignore[misc]
                 for d in order)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_experts(c: Checker, devices: tuple[int, ...], experts: tuple) -> None:
    """Model-free checks of a stage's expert placement (the model's expert count: validate.py)."""
    for d, held in experts:
        where = f"experts.{d}"
        if d not in devices:
            c.add(where, f"device {d} is not one of the stage's devices {list(devices)}")
        if _is_count(held):   # counts left unexpanded: one of them is out of range
            if not 0 <= held <= MAX_EXPERTS:
                c.add(where, f"must be a count of experts in [0, {MAX_EXPERTS}] or a list of expert indices, "
                             f"got {held}")
        elif not isinstance(held, tuple) or not all(_is_count(e) for e in held):
            c.add(where, f"must be a list of expert indices (or, for every device, a count), got {held!r}")
        elif any(e < 0 for e in held):
            c.add(where, f"expert indices must not be negative, got {list(held)}")
        elif len(set(held)) != len(held):
            twice = sorted(e for e, k in Counter(held).items() if k > 1)
            c.add(where, f"lists expert(s) {listed(twice)} more than once")


@dataclass(frozen=True)
class Stage:
    """A TP group and the layer range of each model chunk it holds (one chunk per virtual stage)."""

    devices: tuple[int, ...]
    # YAML accepts (and writes back) one chunk as a bare pair: `layers: [0, 8]`.
    layers: tuple[LayerRange, ...] = field(metadata={"pair_or_list": True})
    recompute: bool = False
    # Partial recompute: only the stage's first ``recompute_layers`` layers (lowest indices, over its chunks)
    # keep just their input and rerun their forward in the backward; the rest keep their activations, so a
    # stage frees just the memory it lacks at a fraction of full recompute's time. None: ``recompute`` says.
    recompute_layers: int | None = None
    # Per chunk, its ops' durations, which the runtime orders the pipeline's action lists by when every
    # stage of the pipeline has them (docs/schedules.md, "Costs in the plan"); None: layer counts.
    op_costs: tuple[OpCosts, ...] | None = None
    # Expert parallelism (docs/moe.md): which routed experts each device of the stage holds whole, by device id,
    # e.g. ``{4: [0, 1, 2], 5: [3]}``; an expert listed under two devices is replicated. Or counts, ``{4: 3,
    # 5: 1}``: consecutive experts in the stage's device order. The same placement serves every MoE layer of
    # the stage. Stored as (device, experts) pairs in the stage's device order (a device not listed holds
    # none); written back as a mapping of lists. None: each expert is split over the stage's TP group like
    # the dense MLP.
    experts: tuple[tuple[int, tuple[int, ...]], ...] | None = field(
        default=None, metadata={"mapping_pairs": True, "or_counts": "device"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if isinstance(self.experts, Mapping):
            object.__setattr__(self, "experts", _placement_pairs(self.devices, self.experts))
        object.__setattr__(self, "layers", _layer_ranges(self.layers))
        if self.op_costs is not None:
            object.__setattr__(self, "op_costs", tuple(tuple(c) for c in self.op_costs))
        with Checker() as c:
            c.check(len(self.devices) >= 1, "devices", "must list at least one device")
            dup = sorted({d for d in self.devices if self.devices.count(d) > 1})
            c.check(not dup, "devices", f"lists device(s) {dup} more than once")
            c.check(all(d >= 0 for d in self.devices), "devices", "device ids must not be negative")
            c.check(len(self.layers) >= 1, "layers", "must hold at least one layer range")
            for k, r in enumerate(self.layers):
                where = "layers" if len(self.layers) == 1 else f"layers[{k}]"
                if len(r) != 2:
                    c.add(where, f"must be a range [start, end), got {list(r)}")
                    continue
                start, end = r
                c.check(0 <= start < end, where,
                        f"must be a non-empty range [start, end) with 0 <= start < end, got [{start}, {end}]")
            for line in [] if self.op_costs is None else op_cost_problems(self.op_costs, len(self.layers)):
                c.add("op_costs", line)
            if self.experts is not None:
                _check_experts(c, self.devices, self.experts)
            k = self.recompute_layers
            if k is not None:
                if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                    c.add("recompute_layers", f"must be an integer >= 0, got {k!r}")
                elif self.recompute:
                    c.add("recompute_layers",
                          "set together with recompute: true (which recomputes every layer); give one")
                elif all(len(r) == 2 for r in self.layers) and k > self.num_layers:
                    c.add("recompute_layers", f"recomputes {k} layers but the stage holds {self.num_layers}")

    @property
    def expert_parallel(self) -> bool:
        """Whether the stage's MoE layers place whole experts on its devices (``experts``)."""
        return self.experts is not None

    def experts_of(self, device: int) -> tuple[int, ...]:
        """The routed experts ``device`` holds whole on this expert-parallel stage (none when unlisted)."""
        return next((e for d, e in self.experts or () if d == device), ())

    def expert_holders(self, expert: int) -> tuple[int, ...]:
        """The devices of this expert-parallel stage holding ``expert``, in the stage's device order."""
        return tuple(d for d in self.devices if expert in self.experts_of(d))

    @property
    def recomputed_layers(self) -> int:
        """How many of the stage's layers recompute their forward in the backward."""
        return self.num_layers if self.recompute else (self.recompute_layers or 0)

    def recompute_text(self) -> str:
        """'yes' (every layer), '3 of 8' (partial recompute) or '' for tables."""
        if self.recompute:
            return "yes"
        return f"{self.recompute_layers} of {self.num_layers}" if self.recompute_layers else ""

    def chunk_recompute(self, chunk: int) -> int:
        """How many layers of chunk ``chunk`` recompute: the stage's ``recomputed_layers`` lowest layer
        indices, wherever its chunks hold them."""
        a, b = self.layers[chunk]
        if self.recompute:
            return b - a
        if not self.recompute_layers:   # (none: the common case, asked per chunk of every pipeline priced)
            return 0
        ids = self.layer_ids[:self.recompute_layers]
        return sum(1 for i in ids if a <= i < b)

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def chunks(self) -> int:
        """v: how many model chunks (virtual stages) this stage holds."""
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        """Layers held, over all chunks."""
        return sum(b - a for a, b in self.layers)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Every layer index held, ascending."""
        return tuple(sorted(i for a, b in self.layers for i in range(a, b)))

    def holds_layer(self, layer: int) -> bool:
        return any(a <= layer < b for a, b in self.layers)

    def layers_data(self) -> list:
        """The YAML / JSON form: ``[0, 8]`` for one chunk, ``[[0, 8], [32, 40]]`` for several."""
        return list(self.layers[0]) if len(self.layers) == 1 else [list(r) for r in self.layers]

    def layers_text(self) -> str:
        """'[0, 8)' or '[0, 8) + [32, 40)' for tables."""
        return " + ".join(f"[{a}, {b})" for a, b in self.layers)


@dataclass(frozen=True)
class Pipeline:
    micro_batches: int
    stages: tuple[Stage, ...]
    schedule: ScheduleName | None = None  # None: training.schedule
    # Seconds of one message between virtual stages j and j + 1 (either direction; 0 where both sit on one
    # stage), which the runtime orders the lists by together with the stages' op_costs (docs/schedules.md,
    # "Costs in the plan"); None: no transfer time.
    transfer_costs: tuple[float, ...] | None = None
    # Per stage the most (micro-batch, chunk) activations it may hold at once, raised above the schedule's
    # own bound where its memory allows (the planner's choice: more forwards ahead, and under a split
    # backward more W deferred into the fill and drain); the action lists are built under it
    # (docs/schedules.md, "Activation limits"). None: the schedule's own bound on every stage.
    activation_limits: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.transfer_costs is not None:
            object.__setattr__(self, "transfer_costs", tuple(self.transfer_costs))
        if self.activation_limits is not None:
            object.__setattr__(self, "activation_limits", tuple(self.activation_limits))
        with Checker() as c:
            c.check(self.micro_batches >= 1, "micro_batches", f"must be at least 1, got {self.micro_batches}")
            c.check(len(self.stages) >= 1, "stages", "must list at least one stage")
            if self.transfer_costs is not None:
                chunks = {st.chunks for st in self.stages}
                boundaries = len(self.stages) * chunks.pop() - 1 if len(chunks) == 1 else None
                c.check(boundaries is None or len(self.transfer_costs) == boundaries, "transfer_costs",
                        f"lists {len(self.transfer_costs)} transfer time(s) for {boundaries} virtual-stage boundaries")
                bad = [t for t in self.transfer_costs
                       if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0)]
                c.check(not bad, "transfer_costs", f"transfer times must be finite seconds >= 0, got {bad}")
            if self.activation_limits is not None:
                c.check(len(self.activation_limits) == len(self.stages), "activation_limits",
                        f"lists {len(self.activation_limits)} limit(s) for {len(self.stages)} stage(s)")
                low = [x for x in self.activation_limits if isinstance(x, bool) or not isinstance(x, int) or x < 1]
                c.check(not low, "activation_limits", f"limits must be integers >= 1, got {low}")

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    def chunk_order(self) -> tuple[tuple[int, int], ...]:
        """(stage, chunk) of every model chunk in layer order: on a valid plan, the virtual stages in
        the schedule's placement order (validation checks the two agree)."""
        return tuple(sorted(((si, c) for si, s in enumerate(self.stages) for c in range(s.chunks)),
                            key=lambda sc: self.stages[sc[0]].layers[sc[1]]))

    @property
    def embed_stage(self) -> int:
        """The stage whose chunk holds layer 0 (and so the embedding)."""
        return self.chunk_order()[0][0]

    @property
    def head_stage(self) -> int:
        """The stage whose chunk holds the last layer (and so the final norm, head and loss)."""
        return self.chunk_order()[-1][0]


@dataclass(frozen=True)
class Strategy:
    name: str
    pipelines: tuple[Pipeline, ...]
    estimates: Mapping[str, float] | None = None
    # The longest document this strategy serves: its length range is (the previous strategy's max_seq_len,
    # max_seq_len]. None: training.seq_len (``max_len_of``).
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(bool(self.name), "name", "must not be empty")
            c.check(len(self.pipelines) >= 1, "pipelines", "must list at least one pipeline")
            c.check(self.max_seq_len is None or self.max_seq_len >= 1, "max_seq_len",
                    f"must be at least 1, got {self.max_seq_len}")

    def max_len_of(self, training: TrainingSettings) -> int:
        """The longest document this strategy serves (``max_seq_len``, else ``training.seq_len``)."""
        return training.seq_len if self.max_seq_len is None else self.max_seq_len

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the strategy uses, pipeline by pipeline, stage by stage."""
        return tuple(d for p in self.pipelines for d in p.devices)

    def schedule_of(self, pipeline: int, training: TrainingSettings) -> ScheduleName:
        """The schedule pipeline ``pipeline`` runs: its own, else the training default."""
        own = self.pipelines[pipeline].schedule
        return own if own is not None else training.schedule

    def locate(self, device: int) -> tuple[int, int, int] | None:
        """(pipeline index, stage index, TP rank) of a device, or None if it is idle."""
        for pi, p in enumerate(self.pipelines):
            for si, s in enumerate(p.stages):
                if device in s.devices:
                    return pi, si, s.devices.index(device)
        return None


@dataclass(frozen=True)
class ProfileRecord:
    """Which device profile priced one device type when the plan was made (written by ``hspmd plan``; read
    by ``hspmd simulate`` to say why its estimate differs): its provenance (measured, imported, spec, or
    datasheet: the cluster file's figures), its file (relative to the plan file; a shipped profile by file
    name with ``shipped``), and per TP degree the plan uses, the components measured, scaled from another
    degree's measurements, or derived from the profile's throughput figures."""

    provenance: str
    path: str | None = None
    shipped: bool = False
    measured: tuple[str, ...] = ()   # "attention@tp1", ...
    scaled: tuple[str, ...] = ()     # "attention@tp2 from tp1", ...
    derived: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.provenance in ("measured", "imported", "spec", "datasheet"), "provenance",
                    f"expected one of measured, imported, spec, datasheet, got {self.provenance!r}")


@dataclass(frozen=True)
class Plan:
    version: int
    model: str
    cluster: str
    training: TrainingSettings
    strategies: tuple[Strategy, ...]
    # Per device type, the profile that priced it (``hspmd plan``); absent in hand-written plans.
    profiles: Mapping[str, ProfileRecord] | None = None

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.version == PLAN_VERSION, "version",
                    f"unsupported plan version {self.version} (this hspmd reads version {PLAN_VERSION})")
            c.check(len(self.strategies) >= 1, "strategies", "must list at least one strategy")
            names = [s.name for s in self.strategies]
            for i, name in enumerate(names):
                if names.index(name) != i:
                    c.add(f"strategies[{i}].name", f"duplicate strategy name {name!r}")

    def strategy(self, name: str | None = None) -> Strategy:
        """The named strategy, or the first one."""
        if name is None:
            return self.strategies[0]
        for s in self.strategies:
            if s.name == name:
                return s
        raise SpecError([Problem("", "strategies", f"no strategy named {name!r} "
                                 f"(have: {', '.join(s.name for s in self.strategies)})")])

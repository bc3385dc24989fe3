"""Timing the runtime's own Llama modules on this machine, per TP shard shape.

Each component is built from runtime/models/llama.py with the shapes one TP rank holds (q/k/v and
gate/up split on their outputs, o/down on their inputs, embedding and head on the vocabulary), run
forward and backward on ``B`` sequences of each length ``s``, and timed (median of repeats, after a
warm-up; CUDA synchronised). Saved activations are counted with ``saved_tensors_hooks`` (unique
storages, parameters excluded). runtime/profiling/fit.py fits the samples.

Components timed alone overcount what a stage pays once per micro-batch (the autograd engine's start,
RoPE tables, the module calls around the layers) and miss the engine's own per-micro-batch code. So
whole **stage blocks** are timed too: the runtime's ``LlamaForCausalLM`` stage module run by the engine's
own micro-batch step (``StageRun``), with 1 and 3 layers and with and without the embedding or head.
Their differences give the per-layer time, a stage's fixed time per micro-batch, and what the embedding
and the head add (``stage_blocks``). The step's epilogue (gradient collection, global norm, clipping,
AdamW on local shards, gradient reset) is timed as ``train_step`` runs it (``measure_step_epilogue``), and
what the runtime's TP layer adds among processes as the TP stage minus its local shards, without and with
sequence parallelism (``measure_tp_overhead``). The TP stages are timed as the engine runs a stage's
micro-batches, back to back (``time_back_to_back``): timed one forward and one backward at a time, a
barrier before each pair and the other variants' in between, a TP stage's collectives and DTensor
dispatch cost other than in a step (by 2-30% on a loaded CPU host; docs/benchmarks.md, bench_tp_profile).

What this does not time: the head's all-gather (its output is materialised by a copy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from runtime.engine.microbatch import window_micro_batch
from runtime.engine.optim import LocalAdamW, clip_coefficient
from runtime.engine.program import (
    OutputRecord,
    StepState,
    stage_backward,
    stage_forward,
    stage_input_grad,
    stage_weight_grad,
)
from runtime.engine.reference import autocast_for, step_casts
from runtime.engine.tensor_parallel import apply_tensor_parallel
from runtime.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, causal_lm_loss_sum, rope_tables
from runtime.profiling.fit import Sample, fit_per_param, trimmed_mean
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.precision import Precision
from runtime.torchfree.profiling.profile import COMPONENTS, OptimizerFit
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import OptimizerSettings


def cuda_framework_gib(device: torch.device) -> float:
    """GPU memory held outside torch's caching allocator (the CUDA context, cuBLAS workspaces, NCCL
    communicators' buffers): the device's used memory less what torch reserved. The whole device's: the
    profiler is meant to have the GPU to itself."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free - torch.cuda.memory_reserved(device)) / 2**30


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shard_attention(model: ModelSpec, tp: int) -> nn.Module:
    att = LlamaAttention(model)
    h, q, kv, bias = model.hidden_size, model.q_dim, model.kv_dim, model.qkv_bias
    att.q_proj = nn.Linear(h, q // tp, bias=bias)
    att.k_proj = nn.Linear(h, kv // tp, bias=bias)
    att.v_proj = nn.Linear(h, kv // tp, bias=bias)
    att.o_proj = nn.Linear(q // tp, h, bias=False)
    return att


def _shard_mlp(model: ModelSpec, tp: int) -> nn.Module:
    mlp = LlamaMLP(model)
    h, f = model.hidden_size, model.ffn_hidden_size
    mlp.gate_proj = nn.Linear(h, f // tp, bias=False)
    mlp.up_proj = nn.Linear(h, f // tp, bias=False)
    mlp.down_proj = nn.Linear(f // tp, h, bias=False)
    return mlp


class _GatheredHead(nn.Module):
    """One TP rank's column of the head, its logits repeated to full rows (the all-gather's shape); with
    ``labels`` their summed loss (the head component)."""

    def __init__(self, model: ModelSpec, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.local = nn.Linear(model.hidden_size, model.vocab_size // tp, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.local(x)
        out = out.repeat(1, 1, self.tp) if self.tp > 1 else out
        return out if labels is None else causal_lm_loss_sum(out, labels)


class _Component:
    """A module plus how to feed it and how to run its backward."""

    def __init__(self, name: str, model: ModelSpec, tp: int, device: torch.device,
                 precision: Precision = "auto") -> None:
        self.name = name
        self.model = model
        self.device = device
        self.precision = precision  # the engine's policy: bf16 autocast on CUDA (tests ask for it on the CPU)
        h = model.hidden_size
        build: dict[str, Callable[[], nn.Module]] = {
            "attention": lambda: _shard_attention(model, tp), "mlp": lambda: _shard_mlp(model, tp),
            "norm": lambda: RMSNorm(h, model.norm_eps), "embedding": lambda: nn.Embedding(model.vocab_size // tp, h),
            "head": lambda: _GatheredHead(model, tp)}
        if name not in build:
            raise ValueError(f"unknown component {name!r} (have: {', '.join(COMPONENTS)})")
        self.module = build[name]().to(device)
        self.params = sum(p.numel() for p in self.module.parameters())
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.module.parameters()}

    def inputs(self, batch: int, seq_len: int) -> tuple:
        d, h = self.device, self.model.hidden_size
        g = torch.Generator(device="cpu").manual_seed(seq_len)
        if self.name == "embedding":
            ids = torch.randint(0, self.module.num_embeddings, (batch, seq_len), generator=g)
            return (ids.to(d),)
        x = torch.randn(batch, seq_len, h, generator=g).to(d).requires_grad_()
        if self.name == "attention":
            cos, sin = rope_tables(seq_len, self.model.head_dim, self.model.rope_theta, d, x.dtype)
            return (x, cos, sin)
        if self.name == "head":
            labels = torch.randint(0, self.model.vocab_size, (batch, seq_len), generator=g).to(d)
            return (x, labels)
        return (x,)

    def forward(self, args: tuple) -> torch.Tensor:
        with autocast_for(self.device, self.precision):
            return self.module(*args)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(None if out.dim() == 0 else torch.ones_like(out))

    def saved_bytes(self, args: tuple) -> float:
        """Bytes of the tensors autograd keeps for backward per micro-batch (unique storages; parameters and
        autocast's weight copies excluded).

        The engine makes each weight's bf16 copy once per step (``step_casts``) and prices it once
        (``MemoryFigures.cast_bytes``), not per micro-batch in flight. So the measured forward runs inside
        ``step_casts`` after a first forward that made the copies: the storages the first one saved that
        the second saves again, other than the inputs, are those copies."""
        def saved_by(out_seen: dict[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
            def pack(t: torch.Tensor) -> torch.Tensor:
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if ptr not in self._param_ptrs:
                    out_seen[ptr] = max(out_seen.get(ptr, 0), st.nbytes())
                return t
            return pack

        first: dict[int, int] = {}
        seen: dict[int, int] = {}
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        with step_casts(self.device, self.precision):
            with torch.autograd.graph.saved_tensors_hooks(saved_by(first), lambda t: t):
                warm = self.forward(args)   # kept alive: the second forward's activations get storages of their own
            with torch.autograd.graph.saved_tensors_hooks(saved_by(seen), lambda t: t):
                out = self.forward(args)
        del out, warm
        self.module.zero_grad(set_to_none=True)
        copies = set(first) - inputs
        return float(sum(n for ptr, n in seen.items() if ptr not in copies))


def time_once(timed: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call, with the device synchronised before and after."""
    synchronize(device)
    c0 = time.process_time()
    t0 = time.perf_counter()
    timed()
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _median_time(run: Callable[[], Callable[[], None]], device: torch.device, *, min_reps: int,
                 max_reps: int, budget_s: float) -> float:
    """Median wall time of the timed part: ``run()`` prepares (untimed) and returns what to time."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        times.append(time_once(run(), device)[0])
    return statistics.median(times)


def _time_forward_backward(comp: _Component, args: tuple, device: torch.device,
                           **kw: Any) -> tuple[float, float]:
    def fwd() -> Callable[[], None]:
        return lambda: comp.forward(args)

    holder: dict[str, torch.Tensor] = {}

    def bwd() -> Callable[[], None]:
        comp.module.zero_grad(set_to_none=True)
        holder["out"] = comp.forward(args)
        return lambda: comp.backward(holder.pop("out"))

    return _median_time(fwd, device, **kw), _median_time(bwd, device, **kw)  # type: ignore[arg-type]


def measure_component(name: str, model: ModelSpec, tp: int, seq_lens: Sequence[int], *, micro_batch: int = 1,
                      device: torch.device | str = "cpu", min_reps: int = 5, max_reps: int = 40,
                      budget_s: float = 0.1, warmup: int = 2) -> tuple[list[Sample], int]:
    """Time one component at each sequence length; returns the samples and its local parameter count."""
    device = torch.device(device)
    comp = _Component(name, model, tp, device)
    samples = []
    for s in seq_lens:
        args = comp.inputs(micro_batch, s)
        # Timed as a step runs them: autocast's weight copies made once (in the warm-up) and reused.
        with step_casts(device):
            for _ in range(warmup):
                comp.backward(comp.forward(args))
            comp.module.zero_grad(set_to_none=True)
            f, b = _time_forward_backward(comp, args, device, min_reps=min_reps, max_reps=max_reps,
                                          budget_s=budget_s)
        samples.append(Sample(s, f, b, comp.saved_bytes(args)))
    return samples, comp.params


# -- whole stage blocks, as the engine runs them ---------------------------------------------------------

# name -> (embedding, head, layers): the stage modules timed; their differences are the blocks.
STAGE_VARIANTS: dict[str, tuple[bool, bool, int]] = {
    "mid1": (False, False, 1), "mid3": (False, False, 3), "first1": (True, False, 1), "last1": (False, True, 1)}


def local_stage(model: ModelSpec, tp: int, num_layers: int, embed: bool, head: bool) -> nn.Module:
    """The runtime's stage module (``LlamaForCausalLM`` with a layer range) at one TP rank's local
    shapes, without DTensor: at TP 1 exactly what a worker builds."""
    stage = LlamaForCausalLM(model, range(num_layers), embed=embed, head=head)
    if tp > 1:
        for layer in stage.model.layers.values():
            layer.self_attn = _shard_attention(model, tp)
            layer.mlp = _shard_mlp(model, tp)
        if embed:
            stage.model.embed_tokens = nn.Embedding(model.vocab_size // tp, model.hidden_size)
        if head:
            stage.lm_head = _GatheredHead(model, tp)  # type: ignore[assignment]
    return stage


class StageRun:
    """One micro-batch through a stage module by the engine's own micro-batch step
    (runtime/engine/program.py ``stage_forward`` / ``stage_backward``), fed as a middle stage is fed: a
    fresh fp32 boundary tensor in, a received output gradient back. Parameter gradients accumulate
    across micro-batches, as in a step."""

    def __init__(self, model: ModelSpec, tp: int, num_layers: int, embed: bool, head: bool, micro_batch: int,
                 seq_len: int, device: torch.device | str, module: nn.Module | None = None) -> None:
        self.device = device = torch.device(device)
        self.embed, self.head = embed, head
        # ``module``: the runtime's TP stage (DTensor), which takes token ids of the whole vocabulary.
        self.module = module if module is not None else local_stage(model, tp, num_layers, embed, head).to(device)
        g = torch.Generator(device="cpu").manual_seed(seq_len)
        vocab = model.vocab_size // tp if embed and module is None else model.vocab_size
        self.rows = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g).to(device)
        self.x = torch.randn(micro_batch, seq_len, model.hidden_size, generator=g).to(device)
        self.grad = torch.randn(micro_batch, seq_len, model.hidden_size, generator=g).to(device) * 1e-3
        self.tokens = micro_batch * seq_len * 8
        self.state = StepState(device)

    def prepare_forward(self) -> Callable[[], None]:
        if not self.embed:
            self.state.inputs[0] = self.x.clone()
        if not self.head:
            self.state.grads_in[0] = self.grad
        return self.forward

    def forward(self) -> None:
        stage_forward(self.module, self.embed, self.head, self.tokens, window_micro_batch(self.rows), 0, self.state)  # type: ignore[arg-type]

    def prepare_backward(self) -> Callable[[], None]:
        self.prepare_forward()
        self.forward()
        synchronize(self.device)
        return self.backward

    def backward(self) -> None:
        stage_backward(self.embed, self.head, 0, self.state)


def time_in_turns(runs: dict[Any, StageRun], device: torch.device, *, min_reps: int, max_reps: int,
                  budget_s: float, warmup: int, barrier: Callable[[], None] | None = None,
                  mean: bool = False) -> dict[Any, tuple[tuple[float, float], tuple[float, float]]]:
    """Median (``mean``: mean) (forward, backward) wall and CPU times of each run; the runs take turns
    within each repeat, so a change of machine load hits them alike. ``barrier``: called before each
    repeat (TP groups)."""
    for r in runs.values():
        for _ in range(warmup):
            r.prepare_backward()()
    times: dict[Any, list[list[list[float]]]] = {k: [[[], []], [[], []]] for k in runs}  # [wall, cpu][phase]
    start = time.perf_counter()
    reps = 0
    while reps < max_reps and (reps < min_reps or time.perf_counter() - start < budget_s * len(runs)):
        if barrier is not None:
            barrier()
        for name, r in runs.items():
            for phase, prep in ((0, r.prepare_forward), (1, r.prepare_backward)):
                for clock, secs in enumerate(time_once(prep(), device)):
                    times[name][clock][phase].append(secs)
        reps += 1
    med = trimmed_mean if mean else statistics.median
    return {k: tuple((med(fwd), med(bwd)) for fwd, bwd in times[k]) for k in runs}  # type: ignore[misc]


def stage_blocks(med: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Stage blocks (forward, backward) from the ``STAGE_VARIANTS`` times: a layer is (3 layers - 1) / 2,
    a middle stage's fixed time the 1-layer stage minus a layer, the embedding and the head what the
    first and last 1-layer stages add to the middle one (none below zero)."""
    layer = tuple(max(0.0, (med["mid3"][i] - med["mid1"][i]) / 2) for i in (0, 1))
    return {"layer": layer,  # type: ignore[dict-item]
            "stage": tuple(max(0.0, med["mid1"][i] - layer[i]) for i in (0, 1)),
            "embedding": tuple(max(0.0, med["first1"][i] - med["mid1"][i]) for i in (0, 1)),
            "head": tuple(max(0.0, med["last1"][i] - med["mid1"][i]) for i in (0, 1))}


def measure_stage_blocks(model: ModelSpec, tp: int, seq_lens: Sequence[int], *, micro_batch: int = 1,
                         device: torch.device | str = "cpu", min_reps: int = 7, max_reps: int = 40,
                         budget_s: float = 0.1, warmup: int = 2) -> dict[str, list[Sample]]:
    """Time the ``STAGE_VARIANTS`` stage modules (local shards of TP rank 0) forward and backward at each
    length; return per-length samples of the blocks: ``layer`` (one decoder layer), ``stage`` (a middle
    stage's fixed time per micro-batch), ``embedding`` and ``head`` (what the first and the last stage
    add). Every (length, variant) takes its turn in every repeat, so a slow spell of a shared machine
    hits all of them alike and the medians pass over it."""
    device = torch.device(device)
    runs = {(s, name): StageRun(model, tp, n, e, h, micro_batch, s, device)
            for s in seq_lens for name, (e, h, n) in STAGE_VARIANTS.items()}
    with step_casts(device):  # weight copies once, as in a step (the warm-up makes them)
        med = time_in_turns(runs, device, min_reps=min_reps, max_reps=max_reps,  # type: ignore[arg-type]
                            budget_s=budget_s, warmup=warmup)
    out: dict[str, list[Sample]] = {k: [] for k in ("layer", "stage", "embedding", "head")}
    for s in seq_lens:
        for k, (f, b) in stage_blocks({name: med[s, name][0] for name in STAGE_VARIANTS}).items():  # type: ignore[index]
            out[k].append(Sample(s, f, b, 0.0))
    return out


def measure_split_blocks(model: ModelSpec, tp: int, seq_lens: Sequence[int], *, micro_batch: int = 1,
                         device: torch.device | str = "cpu", min_reps: int = 7, max_reps: int = 40,
                         budget_s: float = 0.1, warmup: int = 2) -> dict[str, list[Sample]]:
    """The backward of the stage modules without the embedding (``mid1``, ``mid3``, ``last1``) as a
    split-backward schedule runs it (runtime/engine/program.py: the forward records the outputs of the
    modules that own parameters, ``stage_input_grad`` then ``stage_weight_grad``); per length, samples of
    the ``SPLIT_BLOCKS`` as ``stage_blocks`` differences them, ``forward_s`` B and ``backward_s`` W. The
    variants take turns within each repeat, as in ``measure_stage_blocks``."""
    device = torch.device(device)
    names = [n for n, (embed, _, _) in STAGE_VARIANTS.items() if not embed]
    runs = {(s, n): StageRun(model, tp, STAGE_VARIANTS[n][2], False, STAGE_VARIANTS[n][1], micro_batch, s, device)
            for s in seq_lens for n in names}
    records = {k: OutputRecord(r.module) for k, r in runs.items()}
    params = {k: list(r.module.parameters()) for k, r in runs.items()}

    def forward(k: tuple[int, str]) -> None:
        run = runs[k]
        run.prepare_forward()
        with records[k].recording() as outputs:
            run.forward()
        run.state.recorded[0] = outputs
        synchronize(device)

    def input_grad(k: tuple[int, str]) -> Callable[[], None]:
        return lambda: stage_input_grad(False, runs[k].head, 0, runs[k].state, params[k])

    def weight_grad(k: tuple[int, str]) -> Callable[[], None]:
        return lambda: stage_weight_grad(0, runs[k].state)

    times: dict[tuple[int, str], tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
    with step_casts(device):  # weight copies once, as in a step (the warm-up makes them)
        for k in runs:
            for _ in range(warmup):
                forward(k)
                input_grad(k)()
                weight_grad(k)()
        start = time.perf_counter()
        reps = 0
        while reps < max_reps and (reps < min_reps or time.perf_counter() - start < budget_s * len(runs)):
            for k in runs:
                forward(k)
                times[k][0].append(time_once(input_grad(k), device)[0])
                times[k][1].append(time_once(weight_grad(k), device)[0])
            reps += 1
    out: dict[str, list[Sample]] = {k: [] for k in ("layer", "stage", "head")}
    for s in seq_lens:
        med = {n: (statistics.median(times[s, n][0]), statistics.median(times[s, n][1])) for n in names}
        med["first1"] = med["mid1"]   # unused: the embedding's chunk is not split
        for k, (b, w) in stage_blocks(med).items():
            if k in out:
                out[k].append(Sample(s, b, w, 0.0))
    return out


# A TP stage's micro-batches as the engine runs them: a one-stage pipeline's 1F1B step is each micro-batch's
# forward then its backward, back to back (the TP plans the simulator is checked on hold one such stage, with
# 8 micro-batches per step); rounds of such bursts, every run taking its turn in each round. The quick
# profile (``--budget 0``) runs one short round.
TP_MICRO_BATCHES = 8
TP_ROUNDS = 3


def time_back_to_back(runs: dict[Any, StageRun], device: torch.device, *, micro_batches: int, rounds: int,
                      warmup: int = 1, barrier: Callable[[], None] | None = None
                      ) -> dict[Any, tuple[tuple[float, float], tuple[float, float]]]:
    """Mean (forward, backward) wall and process-CPU seconds of one micro-batch of each run, timed as the
    engine runs a stage's micro-batches: ``micro_batches`` of them, forward then backward, back to back,
    nothing else run and nothing waited for between them (``barrier`` only before each burst: a step's
    start). Every run takes its turn in each round, so a change of the host's load hits them alike; per
    run, the trimmed mean over the rounds of each burst's mean (a step pays every stall of its
    micro-batches: means add up)."""
    for r in runs.values():
        for _ in range(warmup):
            r.prepare_backward()()
    bursts: dict[Any, list[list[list[float]]]] = {k: [[[], []], [[], []]] for k in runs}  # [wall, cpu][phase]
    for _ in range(rounds):
        for key, r in runs.items():
            if barrier is not None:
                barrier()
            sums = [[0.0, 0.0], [0.0, 0.0]]
            for _ in range(micro_batches):
                for phase, timed in ((0, r.prepare_forward()), (1, r.backward)):
                    for clock, secs in enumerate(time_once(timed, device)):
                        sums[clock][phase] += secs
            for clock in (0, 1):
                for phase in (0, 1):
                    bursts[key][clock][phase].append(sums[clock][phase] / micro_batches)
    return {k: tuple((trimmed_mean(f), trimmed_mean(b)) for f, b in bursts[k]) for k in runs}  # type: ignore[misc]


def tp_overhead_blocks(tp: dict[str, tuple[float, float]], local: dict[str, tuple[float, float]]
                       ) -> dict[str, tuple[float, float]]:
    """The difference method on whole stages: what TP adds to each ``STAGE_VARIANTS`` stage (the TP stage's
    (forward, backward) time minus the plain local shards', none below zero), then ``stage_blocks`` of
    those: per layer (3 layers - 1) / 2, the rest as there."""
    return stage_blocks({name: tuple(max(0.0, tp[name][j] - local[name][j]) for j in (0, 1))  # type: ignore[misc]
                         for name in STAGE_VARIANTS})


def measure_tp_overhead(model: ModelSpec, tp: int, group, seq_lens: Sequence[int], *, device: torch.device | str,
                        micro_batch: int = 1, micro_batches: int = TP_MICRO_BATCHES, rounds: int = TP_ROUNDS
                        ) -> dict[str, dict[str, list[Sample]]] | None:
    """What tensor parallelism adds to each stage block: the runtime's TP stage modules
    (``apply_tensor_parallel``: DTensor over ``group``, its collectives included), without and with
    sequence parallelism, minus the same local shards run plainly, every one timed as the engine runs a
    stage's micro-batches (``time_back_to_back``) and differenced by ``tp_overhead_blocks``. Call on every
    member of ``group`` (the first ``tp`` ranks); the group's first rank returns ``{"wall": blocks, "cpu":
    blocks, "sp_wall": blocks, "sp_cpu": blocks}`` (block -> per-length samples; CPU time is what an
    emulated device's sleep is a multiple of; ``sp_*``: sequence parallel, at the lengths ``tp`` divides),
    the others None."""
    device = torch.device(device)
    mesh = DeviceMesh.from_group(group, device.type)
    first = dist.get_rank(group) == 0

    def tp_stage(n: int, embed: bool, head: bool, sp: bool) -> nn.Module:
        stage = LlamaForCausalLM(model, range(n), embed=embed, head=head).to(device)
        infos = [i for i in llama_parameters(model) if (i.owner == "embedding" and embed) or
                 (i.owner == "head" and head) or (i.owner == "layer" and i.layer is not None and i.layer < n)]
        apply_tensor_parallel(stage, infos, mesh, sequence_parallel=sp)
        return stage

    kinds = {"": False, "sp_": True}
    runs = {}
    for s in seq_lens:
        for name, (e, h, n) in STAGE_VARIANTS.items():
            runs[s, name, None] = StageRun(model, tp, n, e, h, micro_batch, s, device)
            for kind, sp in kinds.items():
                if not sp or s % tp == 0:   # sequence parallel shards the sequence evenly
                    runs[s, name, kind] = StageRun(model, tp, n, e, h, micro_batch, s, device,
                                                   module=tp_stage(n, e, h, sp))
    dist.barrier(group=group)
    with step_casts(device):  # weight copies once, as in a step
        times = time_back_to_back(runs, device, micro_batches=micro_batches, rounds=rounds,
                                  barrier=lambda: dist.barrier(group=group))
    out: dict[str, dict[str, list[Sample]]] = {f"{kind}{clock}": {} for kind in kinds for clock in ("wall", "cpu")}
    for s in seq_lens:
        for kind in kinds:
            if (s, "mid1", kind) not in runs:
                continue
            for clock, i in (("wall", 0), ("cpu", 1)):
                blocks = tp_overhead_blocks({name: times[s, name, kind][i] for name in STAGE_VARIANTS},
                                            {name: times[s, name, None][i] for name in STAGE_VARIANTS})
                for k, (f, b) in blocks.items():
                    out[f"{kind}{clock}"].setdefault(k, []).append(Sample(s, f, b, 0.0))
    return out if first else None


def measure_step_epilogue(models: Sequence[ModelSpec], tp_degrees: Sequence[int], *,
                          device: torch.device | str = "cpu", micro_batch: int = 1, seq_len: int = 64,
                          reps: int = 7) -> tuple[OptimizerFit, OptimizerFit, float]:
    """The end of a step on the parameters of real stages, right after their backward (as the caches are
    then), as ``DeviceProgram.train_step`` runs it: the optimizer span (gradients scaled by the clip
    coefficient, AdamW on the local shards: ``LocalAdamW.step``), and the code outside any span
    (local gradients collected, the squared norm summed tensor by tensor, the statistics stacked, the
    gradients reset). For every model, TP degree and ``STAGE_VARIANTS`` stage; each fitted as
    ``seconds_per_param * params + seconds_per_tensor * tensors + fixed_s``. Returns (optimizer fit,
    outside-span fit, the optimizer fit's largest relative error)."""
    device = torch.device(device)
    rows: list[tuple[float, float]] = []
    opt_ys: list[float] = []
    over_ys: list[float] = []
    for model in models:
        s = min(seq_len, model.max_seq_len)
        for tp in tp_degrees:
            for embed, head, n in STAGE_VARIANTS.values():
                run = StageRun(model, tp, n, embed, head, micro_batch, s, device)
                params = dict(run.module.named_parameters())
                opt = LocalAdamW({k: p.detach() for k, p in params.items()}, OptimizerSettings())
                t_opt, t_over = [], []
                for i in range(reps + 1):
                    for p in params.values():   # the step's start
                        p.grad = None
                    run.prepare_backward()()
                    synchronize(device)
                    t0 = time.perf_counter()
                    grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}
                    norm_sq = torch.zeros((), dtype=torch.float32, device=device)
                    for g in grads.values():
                        norm_sq += g.float().pow(2).sum()
                    stats = torch.stack([run.state.loss_sum.float(), norm_sq])
                    norm = stats[1].sqrt()
                    synchronize(device)
                    t1 = time.perf_counter()
                    opt.step(grads, clip_coefficient(norm, 1.0))
                    synchronize(device)
                    t2 = time.perf_counter()
                    for p in params.values():
                        p.grad = None
                    float(stats[0])
                    t3 = time.perf_counter()
                    if i > 0:   # the first step allocates the AdamW states
                        t_opt.append(t2 - t1)
                        t_over.append(t1 - t0 + t3 - t2)
                rows.append((sum(p.numel() for p in params.values()), len(params)))
                opt_ys.append(statistics.median(t_opt))
                over_ys.append(statistics.median(t_over))
    opt, resid = fit_per_param(rows, opt_ys)
    return opt, fit_per_param(rows, over_ys)[0], resid


def measure_sync_pack(models: Sequence[ModelSpec], tp_degrees: Sequence[int], *,
                      device: torch.device | str = "cpu", reps: int = 9) -> OptimizerFit:
    """The local work of the cross-pipeline gradient sync around its all-reduce, as
    runtime/torchfree/comm/gradsync.py ``GradientSync.sync`` does it: each gradient's slice flattened and
    concatenated into the bucket, then copied back slice by slice. On the gradients of every
    ``STAGE_VARIANTS`` stage; fitted per parameter, per tensor and fixed (``OptimizerFit``'s form)."""
    device = torch.device(device)
    rows: list[tuple[float, float]] = []
    ys: list[float] = []
    for model in models:
        for tp in tp_degrees:
            for embed, head, n in STAGE_VARIANTS.values():
                module = local_stage(model, tp, n, embed, head).to(device)
                grads = {k: torch.randn(p.shape, device=device) for k, p in module.named_parameters()}
                regions = {k: tuple(slice(0, d) for d in g.shape) for k, g in grads.items()}

                def run(grads: dict = grads, regions: dict = regions) -> Callable[[], None]:
                    def sync() -> None:
                        for k, g in grads.items():
                            if tuple(g.shape) != tuple(e.stop for e in regions[k]):
                                raise AssertionError(k)
                        flat = torch.cat([g[regions[k]].reshape(-1) for k, g in grads.items()])
                        off = 0
                        for k, g in grads.items():
                            size = g.numel()
                            g[regions[k]] = flat[off:off + size].view(g.shape)
                            off += size
                    return sync

                ys.append(_median_time(run, device, min_reps=reps, max_reps=reps, budget_s=0.0))
                rows.append((sum(g.numel() for g in grads.values()), len(grads)))
    return fit_per_param(rows, ys)[0]


def measure_throughput(device: torch.device | str = "cpu") -> dict[str, float]:
    """Model-independent figures: GEMM rate (TFLOPS), copy bandwidth (GB/s), per-op overhead (s)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # Several back to back per timed call: one GEMM on a GPU (~0.2 ms) is short enough that the launch and
    # the host synchronisation around it would take 5-10% off the rate.
    reps = 10 if device.type == "cuda" else 1
    gemm = _median_time(lambda: (lambda: [a @ b for _ in range(reps)]), device, min_reps=5, max_reps=20,
                        budget_s=0.1) / reps
    size = (256 if device.type == "cuda" else 16) * 2**20 // 4
    src = torch.randn(size, device=device)
    dst = torch.empty_like(src)
    copy = _median_time(lambda: (lambda: [dst.copy_(src) for _ in range(reps)]), device, min_reps=5, max_reps=20,
                        budget_s=0.1) / reps
    one = torch.ones(1, device=device)
    op = _median_time(lambda: (lambda: [one.add(one) for _ in range(100)]), device, min_reps=5, max_reps=20,
                      budget_s=0.05) / 100
    return {"tflops": 2.0 * n**3 / gemm / 1e12, "bandwidth_gbs": 2.0 * size * 4 / copy / 1e9, "op_s": op}

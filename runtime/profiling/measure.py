"""Timing the runtime's own Llama modules on this machine, per TP shard shape, and fitting the costs.

Each component is built from runtime/models/llama.py with the shapes one TP rank holds (q/k/v and
gate/up split on their outputs, o/down on their inputs, embedding and head on the vocabulary), run
forward and backward on ``B`` sequences of each length ``s``, and timed (median of repeats, after a
warm-up; CUDA synchronised). Saved activations are counted with ``saved_tensors_hooks`` (unique
storages, parameters excluded). Each series is fitted with ``a*s^2 + b*s + c`` by least squares on
relative error, keeping only non-negative coefficients.

Components timed alone overcount what a stage pays once per micro-batch (the autograd engine's start,
RoPE tables, the module calls around the layers) and miss the engine's own per-micro-batch code. So
whole **stage blocks** are timed too: the runtime's ``LlamaForCausalLM`` stage module run as the engine
runs one micro-batch (runtime/engine/program.py ``_forward``/``_backward``: loss and its scaling on the
last stage, the fp32 boundary copy on the others, the input gradient handed back), with 1 and 3 layers
and with and without the embedding or head. Their differences give the per-layer time, a stage's fixed
time per micro-batch, and what the embedding and the head add (``stage_blocks``). The step's epilogue
(gradient collection, global norm, clipping, AdamW on local shards, gradient reset) is timed as
``train_step`` runs it (``measure_optimizer``).

What this does not time: the TP collectives and DTensor dispatch (``measure_tp_overhead`` measures what
the runtime's TP layer adds among processes), and the head's all-gather (its output is materialised by a
copy).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.models.llama import LlamaAttention, LlamaMLP, RMSNorm, causal_lm_loss_sum, rope_tables
from runtime.profiling.profile import (
    COMPONENTS,
    ComponentFit,
    Fit,
    LinkFit,
    MeasuredModel,
    OptimizerFit,
    ResumePenalty,
)
from runtime.spec.model import ModelSpec


@dataclass(frozen=True)
class Sample:
    seq_len: int
    forward_s: float
    backward_s: float
    activation_bytes: float


def autocast(device: torch.device):
    """The runtime's precision policy: bf16 autocast on CUDA, fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


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


class _Head(nn.Module):
    """The column-parallel head of one TP rank: local logits, the gathered full rows, the sum loss."""

    def __init__(self, model: ModelSpec, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.lm_head = nn.Linear(model.hidden_size, model.vocab_size // tp, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        local = self.lm_head(x)
        full = local.repeat(1, 1, self.tp) if self.tp > 1 else local
        return causal_lm_loss_sum(full, labels)


class _Component:
    """A module plus how to feed it and how to run its backward."""

    def __init__(self, name: str, model: ModelSpec, tp: int, device: torch.device) -> None:
        self.name = name
        self.model = model
        self.device = device
        h = model.hidden_size
        if name == "attention":
            self.module: nn.Module = _shard_attention(model, tp)
        elif name == "mlp":
            self.module = _shard_mlp(model, tp)
        elif name == "norm":
            self.module = RMSNorm(h, model.norm_eps)
        elif name == "embedding":
            self.module = nn.Embedding(model.vocab_size // tp, h)
        elif name == "head":
            self.module = _Head(model, tp)
        else:
            raise ValueError(f"unknown component {name!r} (have: {', '.join(COMPONENTS)})")
        self.module.to(device)
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
        with autocast(self.device):
            return self.module(*args)

    def backward(self, out: torch.Tensor) -> None:
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(torch.ones_like(out))

    def saved_bytes(self, args: tuple) -> float:
        """Bytes of the tensors autograd keeps for backward (unique storages, parameters excluded)."""
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self._param_ptrs:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.forward(args)
        del out
        self.module.zero_grad(set_to_none=True)
        return float(sum(seen.values()))


def _time_once(timed: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(wall, process CPU) seconds of one call, with the device synchronised before and after."""
    synchronize(device)
    c0 = time.process_time()
    t0 = time.perf_counter()
    timed()
    synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _median_time(run: Callable[[], Callable[[], None]], device: torch.device, *, min_reps: int,
                 max_reps: int, budget_s: float, cpu: list[float] | None = None) -> float:
    """Median wall time of the timed part: ``run()`` prepares (untimed) and returns what to time.
    ``cpu``: if given, gets the median process (CPU) time of the timed part appended."""
    times: list[float] = []
    cpus: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        wall_s, cpu_s = _time_once(run(), device)
        times.append(wall_s)
        cpus.append(cpu_s)
    if cpu is not None:
        cpu.append(statistics.median(cpus))
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
        for _ in range(warmup):
            comp.backward(comp.forward(args))
        comp.module.zero_grad(set_to_none=True)
        f, b = _time_forward_backward(comp, args, device, min_reps=min_reps, max_reps=max_reps, budget_s=budget_s)
        samples.append(Sample(s, f, b, comp.saved_bytes(args)))
    return samples, comp.params


# -- whole stage blocks, as the engine runs them ---------------------------------------------------------

# name -> (embedding, head, layers): the stage modules timed; their differences are the blocks.
STAGE_VARIANTS: dict[str, tuple[bool, bool, int]] = {
    "mid1": (False, False, 1), "mid3": (False, False, 3), "first1": (True, False, 1), "last1": (False, True, 1)}


class _GatheredHead(nn.Module):
    """One TP rank's column of the head, its logits repeated to full rows (the all-gather's shape)."""

    def __init__(self, model: ModelSpec, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.local = nn.Linear(model.hidden_size, model.vocab_size // tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local(x)
        return out.repeat(1, 1, self.tp) if self.tp > 1 else out


def local_stage(model: ModelSpec, tp: int, num_layers: int, embed: bool, head: bool) -> nn.Module:
    """The runtime's stage module (``LlamaForCausalLM`` with a layer range) at one TP rank's local
    shapes, without DTensor: at TP 1 exactly what a worker builds."""
    from runtime.models.llama import LlamaForCausalLM

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


class _StageRun:
    """One micro-batch through a stage module the way runtime/engine/program.py runs it: forward
    (token ids in on the first stage, a fresh fp32 boundary tensor elsewhere; the summed loss scaled by
    the token count on the last stage, the fp32 copy of the output to send elsewhere), then backward
    (from the scaled loss, or from the received output gradient; the input gradient taken out).
    Parameter gradients accumulate across micro-batches, as in a step."""

    def __init__(self, model: ModelSpec, tp: int, num_layers: int, embed: bool, head: bool, micro_batch: int,
                 seq_len: int, device: torch.device, module: nn.Module | None = None) -> None:
        self.device = device
        self.embed, self.head = embed, head
        # ``module``: the runtime's TP stage (DTensor), which takes token ids of the whole vocabulary.
        self.module = module if module is not None else local_stage(model, tp, num_layers, embed, head).to(device)
        g = torch.Generator(device="cpu").manual_seed(seq_len)
        vocab = model.vocab_size // tp if embed and module is None else model.vocab_size
        self.ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=g).to(device)
        self.labels = torch.randint(0, model.vocab_size, (micro_batch, seq_len), generator=g).to(device)
        self.x = torch.randn(micro_batch, seq_len, model.hidden_size, generator=g).to(device)
        self.grad = torch.randn(micro_batch, seq_len, model.hidden_size, generator=g).to(device) * 1e-3
        self.tokens = micro_batch * seq_len * 8
        self.loss_sum = torch.zeros((), device=device)
        self._input: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def prepare_forward(self) -> Callable[[], None]:
        self._input = None if self.embed else self.x.clone()
        return self.forward

    def forward(self) -> None:
        x = self.ids if self.embed else self._input.requires_grad_()  # type: ignore[union-attr]
        with autocast(self.device):
            out = self.module(x)
        if self.head:
            loss = causal_lm_loss_sum(out, self.labels)
            self.loss_sum = self.loss_sum + loss.detach()
            self._out = loss / self.tokens
        else:
            self._out = out
            self._sent = out.detach().to(torch.float32)

    def prepare_backward(self) -> Callable[[], None]:
        self.prepare_forward()
        self.forward()
        synchronize(self.device)
        return self.backward

    def backward(self) -> None:
        out = self._out
        assert out is not None
        self._out = None
        if self.head:
            out.backward()
        else:
            out.backward(self.grad.to(out.dtype))
        if not self.embed:
            assert self._input is not None
            self._grad_out = self._input.grad
            self._input.grad = None


def _time_stage_runs(runs: dict[Any, _StageRun], device: torch.device, *, min_reps: int, max_reps: int,
                     budget_s: float, warmup: int, barrier: Callable[[], None] | None = None,
                     mean: bool = False) -> dict[Any, tuple[tuple[float, float], tuple[float, float]]]:
    """Median (``mean``: mean) (forward, backward) wall and CPU times of each run; the runs take turns
    within each repeat, so a change of machine load hits them alike. ``barrier``: called before each
    repeat (TP groups)."""
    for r in runs.values():
        for _ in range(warmup):
            r.prepare_backward()()
    wall: dict[Any, tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
    cpu: dict[Any, tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
    start = time.perf_counter()
    reps = 0
    while reps < max_reps and (reps < min_reps or time.perf_counter() - start < budget_s * len(runs)):
        if barrier is not None:
            barrier()
        for name, r in runs.items():
            for phase, prep in ((0, r.prepare_forward), (1, r.prepare_backward)):
                wall_s, cpu_s = _time_once(prep(), device)
                wall[name][phase].append(wall_s)
                cpu[name][phase].append(cpu_s)
            r._out = None
        reps += 1
    med = trimmed_mean if mean else statistics.median
    return {k: ((med(wall[k][0]), med(wall[k][1])), (med(cpu[k][0]), med(cpu[k][1]))) for k in runs}


def _blocks(med: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
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
    runs = {(s, name): _StageRun(model, tp, n, e, h, micro_batch, s, device)
            for s in seq_lens for name, (e, h, n) in STAGE_VARIANTS.items()}
    med = _time_stage_runs(runs, device, min_reps=min_reps, max_reps=max_reps, budget_s=budget_s,  # type: ignore[arg-type]
                           warmup=warmup)
    out: dict[str, list[Sample]] = {k: [] for k in ("layer", "stage", "embedding", "head")}
    for s in seq_lens:
        for k, (f, b) in _blocks({name: med[s, name][0] for name in STAGE_VARIANTS}).items():  # type: ignore[index]
            out[k].append(Sample(s, f, b, 0.0))
    return out


def measure_tp_overhead(model: ModelSpec, tp: int, group, seq_lens: Sequence[int], *, device: torch.device | str,
                        micro_batch: int = 1, reps: int = 9) -> dict[str, dict[str, list[Sample]]] | None:
    """What tensor parallelism adds to each stage block: the runtime's TP stage modules
    (``apply_tensor_parallel``: DTensor over ``group``, its collectives included) minus the same local
    shards run plainly, both as the engine runs a micro-batch. Call on every member of ``group`` (the
    first ``tp`` ranks); the group's first rank returns ``{"wall": blocks, "cpu": blocks}`` (block ->
    per-length samples; CPU time is what an emulated device's sleep is a multiple of), the others None."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from runtime.engine.tensor_parallel import apply_tensor_parallel
    from runtime.models.llama import LlamaForCausalLM
    from runtime.models.params import llama_parameters

    device = torch.device(device)
    mesh = DeviceMesh.from_group(group, device.type)
    first = dist.get_rank(group) == 0

    def tp_stage(n: int, embed: bool, head: bool) -> nn.Module:
        stage = LlamaForCausalLM(model, range(n), embed=embed, head=head).to(device)
        infos = [i for i in llama_parameters(model) if (i.owner == "embedding" and embed) or
                 (i.owner == "head" and head) or (i.owner == "layer" and i.layer is not None and i.layer < n)]
        apply_tensor_parallel(stage, infos, mesh)
        return stage

    out: dict[str, dict[str, list[Sample]]] = {"wall": {}, "cpu": {}}
    runs = {}
    for s in seq_lens:
        for name, (e, h, n) in STAGE_VARIANTS.items():
            runs[s, f"tp {name}"] = _StageRun(model, tp, n, e, h, micro_batch, s, device, module=tp_stage(n, e, h))
            runs[s, name] = _StageRun(model, tp, n, e, h, micro_batch, s, device)
    dist.barrier(group=group)
    # Means: a step pays every collective's occasional stall (on a shared host, a few ms when a waiting
    # process's core has gone idle), so the mean is what adds up, not the typical time.
    med = _time_stage_runs(runs, device, min_reps=reps, max_reps=reps, budget_s=0.0, warmup=2,  # type: ignore[arg-type]
                           barrier=lambda: dist.barrier(group=group), mean=True)
    for s in seq_lens:
        for kind, i in (("wall", 0), ("cpu", 1)):
            diff = {name: tuple(max(0.0, med[s, f"tp {name}"][i][j] - med[s, name][i][j]) for j in (0, 1))
                    for name in STAGE_VARIANTS}
            for k, (f, b) in _blocks(diff).items():  # type: ignore[arg-type]
                out[kind].setdefault(k, []).append(Sample(s, f, b, 0.0))
    return out if first else None


def measure_resume_penalty(model: ModelSpec, seq_len: int, *, device: torch.device | str = "cpu",
                           idles_s: Sequence[float] = (0.0005, 0.002, 0.008, 0.032), reps: int = 25,
                           micro_batch: int = 1) -> ResumePenalty:
    """How much longer a stage block (one decoder layer, TP 1, as the engine runs it) takes when the
    process idled (slept) for ``t`` before it than right after other work: the two take turns, for
    each ``t`` of ``idles_s``; the mean differences (forward, backward) fitted with
    ``peak * (1 - exp(-t / tau))`` (tau from a log grid, peaks by least squares, none below zero)."""
    device = torch.device(device)
    run = _StageRun(model, 1, 1, False, False, micro_batch, seq_len, device)
    for _ in range(3):
        run.prepare_backward()()
    extra: list[tuple[float, float]] = []
    for idle in idles_s:
        times: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
        for _ in range(reps):
            for after_idle in (False, True):
                fwd = run.prepare_forward()
                if after_idle:
                    time.sleep(idle)
                synchronize(device)
                t0 = time.perf_counter()
                fwd()
                synchronize(device)
                t1 = time.perf_counter()
                if after_idle:
                    time.sleep(idle)
                t2 = time.perf_counter()
                run.backward()
                synchronize(device)
                times[after_idle][0].append(t1 - t0)
                times[after_idle][1].append(time.perf_counter() - t2)
        extra.append(tuple(statistics.mean(times[True][i]) - statistics.mean(times[False][i])  # type: ignore[misc]
                           for i in (0, 1)))
    (fwd_s, bwd_s), tau = _fit_saturating(idles_s, extra)
    return ResumePenalty(forward_s=fwd_s, backward_s=bwd_s, tau_s=tau)


def _fit_saturating(idles_s: Sequence[float], extra: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], float]:
    """Fit ``extra[j][i] ~ peak_i * (1 - exp(-idles_s[j] / tau))``: one tau shared by every column i,
    from a log grid (0.1 ms up to the longest idle measured: no extrapolated growth), the peaks by least
    squares, none below zero. Returns (peaks, tau)."""
    cols = range(len(extra[0]))
    best: tuple[float, tuple[float, ...], float] | None = None
    for k in range(41):
        tau = 1e-4 * 10 ** (k / 10)
        if tau > max(idles_s):
            break
        shape = [1.0 - math.exp(-t / tau) for t in idles_s]
        norm = sum(x * x for x in shape)
        peaks = tuple(max(0.0, sum(x * e[i] for x, e in zip(shape, extra)) / norm) if norm > 0 else 0.0
                      for i in cols)
        err = sum((peaks[i] * x - e[i]) ** 2 for x, e in zip(shape, extra) for i in cols)
        if best is None or err < best[0]:
            best = (err, peaks, tau)
    assert best is not None
    return best[1], best[2]


def core_sharing(rank: int, pair: tuple[int, int], model: ModelSpec, seq_lens: Sequence[int], *,
                 device: torch.device | str = "cpu", duration_s: float = 0.5) -> dict[int, float]:
    """How well two processes pinned to one core share it (inside an initialised process group; ranks
    ``pair`` share a core, as the launcher pins two emulated devices when cores are fewer than devices):
    a one-layer stage block (forward and backward, as the engine runs it) is run for ``duration_s`` by
    the first rank alone, then by both at once. Returns ``{seq_len: efficiency}`` on every rank, where
    efficiency = (time per block alone) / (time per block shared / 2): 1 when time-slicing costs nothing,
    less when each switch leaves the other process cold caches."""
    import torch.distributed as dist

    device = torch.device(device)
    out: dict[int, float] = {}
    for s in seq_lens:
        run = _StageRun(model, 1, 1, False, False, 1, s, device)
        for _ in range(2):
            run.prepare_backward()()
        per_block = []
        for both in (False, True):
            dist.barrier()
            if rank == pair[0] or (both and rank == pair[1]):
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < duration_s:
                    run.prepare_backward()()
                    n += 1
                per_block.append((time.perf_counter() - t0) / n)
            else:
                time.sleep(duration_s)
                per_block.append(0.0)
        res = torch.tensor([per_block[0], per_block[1], 1.0 if rank in pair else 0.0], dtype=torch.float64)
        dist.all_reduce(res)
        alone = res[0].item()                    # only the pair's first rank ran alone
        shared = res[1].item() / max(1.0, res[2].item())
        out[s] = min(1.0, alone / (shared / 2)) if shared > 0 else 1.0
    return out


def busy_core_handoff(rank: int, pair: tuple[int, int], model: ModelSpec, seq_lens: Sequence[int], *,
                      peer: int | None = None, sleep_ratio: float = 2.0, device: torch.device | str = "cpu",
                      duration_s: float = 0.6, peer_wait_s: float = 0.001) -> dict[int, dict[str, dict[str, float]]]:
    """How long an emulated device's process waits for its core around its compute blocks when the other
    process pinned to that core computes meanwhile (inside an initialised process group; ranks ``pair``
    share a core, ``peer`` runs on another one). The pair's first rank runs the runtime's duty cycle of an
    emulated device (one-layer stage block forward, then backward, each wrapped in ``EmulatedSlowdown``: a
    sleep of ``sleep_ratio`` times its CPU time after it; after each sleep, with a ``peer``, a blocking
    receive that the peer answers ``peer_wait_s`` later), first with the second rank idle, then with it
    computing stage blocks nonstop. Per sequence length and case ("idle", "busy"), the means over the
    blocks of: ``wall`` of a block, its CPU time (``cpu_forward``, ``cpu_backward``: more with the core-mate
    computing, whose work meanwhile took over the caches); ``gap`` from a block's end to the start of its sleep (the
    process runnable, the core taken: a time-slicing scheduler switches when a process that used up its
    slice makes a system call, here the CPU-time read that sizes the sleep); ``late``: how much later than
    asked it runs after its sleep; ``recv``: from the peer's send to the receive's return. Returned on
    every rank (the first rank's figures)."""
    import torch.distributed as dist

    from runtime.trace import EmulatedSlowdown

    device = torch.device(device)
    out: dict[int, dict[str, dict[str, float]]] = {}
    keys = ("wall", "cpu_forward", "cpu_backward", "gap", "late", "recv")
    flag = torch.zeros(1, dtype=torch.float64)
    for s in seq_lens:
        run = _StageRun(model, 1, 1, False, False, 1, s, device)
        for _ in range(2):
            run.prepare_backward()()
        out[s] = {}
        for case in ("idle", "busy"):
            dist.barrier()
            sums = torch.zeros(len(keys), dtype=torch.float64)
            if rank == pair[0]:
                rec = _DutyRecorder(sleep_ratio)
                slow = EmulatedSlowdown(1.0 + sleep_ratio, rec, sleep=rec.sleep)
                recv: list[float] = []
                t_end = time.perf_counter() + duration_s
                while time.perf_counter() < t_end:
                    fwd = run.prepare_forward()
                    for name, block in (("forward", fwd), ("backward", run.backward)):
                        with slow.span("compute", name):
                            block()
                        if peer is not None:
                            dist.send(flag.fill_(1.0), peer)
                            dist.recv(flag, peer)
                            recv.append(time.perf_counter() - flag.item())
                if peer is not None:
                    dist.send(flag.fill_(0.0), peer)
                rows = rec.rows[2:] or rec.rows   # the first blocks of a phase start from a cold core
                series = {"wall": [r[0] for r in rows], "cpu_forward": [r[1] for r in rows if r[4] == "forward"],
                          "cpu_backward": [r[1] for r in rows if r[4] == "backward"], "gap": [r[2] for r in rows],
                          "late": [r[3] for r in rows], "recv": recv[2:] or recv}
                for i, k in enumerate(keys):
                    sums[i] = statistics.fmean(series[k]) if series[k] else 0.0
            elif rank == peer:
                while True:
                    dist.recv(flag, pair[0])
                    if flag.item() == 0.0:
                        break
                    time.sleep(peer_wait_s)
                    dist.send(flag.fill_(time.perf_counter()), pair[0])
            elif rank == pair[1] and case == "busy":
                t_end = time.perf_counter() + duration_s + 0.05
                while time.perf_counter() < t_end:
                    run.prepare_backward()()
            else:
                time.sleep(duration_s)
            dist.all_reduce(sums)
            out[s][case] = {k: sums[i].item() for i, k in enumerate(keys)}
    return out


class _DutyRecorder:
    """Hooks for ``EmulatedSlowdown`` that time each compute block, its hand-off gap and its sleep."""

    def __init__(self, sleep_ratio: float) -> None:
        self.sleep_ratio = sleep_ratio
        self.start = self.end = 0.0
        self.name = ""
        self.rows: list[tuple[float, float, float, float, str]] = []   # (wall, cpu, gap, late, name) per block

    @contextlib.contextmanager
    def span(self, kind: str, name: str, **args: Any) -> Iterator[None]:
        if kind == "compute":
            self.start, self.name = time.perf_counter(), name
        yield
        if kind == "compute":
            self.end = time.perf_counter()

    def sleep(self, secs: float) -> None:
        t0 = time.perf_counter()
        time.sleep(secs)
        late = max(0.0, time.perf_counter() - t0 - secs)
        self.rows.append((self.end - self.start, secs / self.sleep_ratio, t0 - self.end, late, self.name))


def trimmed_mean(xs: Sequence[float], cut: float = 0.1) -> float:
    """Mean without the top and bottom ``cut`` fraction: what a sum of many such operations averages
    (occasional stalls included), without the rare outlier of a foreign process."""
    ys = sorted(xs)
    k = int(len(ys) * cut)
    ys = ys[k:len(ys) - k] or ys
    return sum(ys) / len(ys)


def nonneg_lstsq(columns: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[list[float], float]:
    """``y ~ sum_i coef_i * column_i`` by least squares on relative error, every coefficient >= 0: the
    best fit over the subsets of columns whose solution is non-negative (the others are 0). Returns the
    coefficients and the largest relative error at the points. Errors are relative to at least a tenth
    of the largest ``|y|``, so that a point near zero (a difference of noisy times) does not pin the fit."""
    y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
    cols = [torch.tensor([float(v) for v in c], dtype=torch.float64) for c in columns]
    floor = max(1e-30, 0.1 * float(y.abs().max())) if len(ys) else 1e-30
    w = 1.0 / torch.clamp(y.abs(), min=floor)
    best: tuple[float, list[float]] | None = None
    for k in range(1, len(cols) + 1):
        for subset in itertools.combinations(range(len(cols)), k):
            if len(subset) > len(ys):
                continue
            a = torch.stack([cols[i] * w for i in subset], dim=1)
            sol = torch.linalg.lstsq(a, (y * w).unsqueeze(1)).solution.squeeze(1)
            if bool((sol < 0).any()):
                continue
            coef = [0.0] * len(cols)
            for i, v in zip(subset, sol.tolist()):
                coef[i] = v
            pred = sum(coef[i] * cols[i] for i in range(len(cols)))
            err = float((((pred - y) * w) ** 2).sum())
            if best is None or err < best[0] - 1e-15:
                best = (err, coef)
    if best is None:  # every y is zero (or negative): a zero fit
        return [0.0] * len(cols), 0.0
    coef = best[1]
    pred = sum(coef[i] * cols[i] for i in range(len(cols)))
    resid = float((((pred - y) * w).abs()).max()) if float(y.abs().max()) > 0 else 0.0
    return coef, resid


def fit_quadratic(xs: Sequence[float], ys: Sequence[float], batch: int = 1,
                  terms: Sequence[int] = (0, 1, 2)) -> tuple[Fit, float]:
    """``y = a*B*x^2 + b*B*x + c`` with non-negative coefficients, only ``terms`` (0 = a, 1 = b, 2 = c)
    free. Returns the fit and the largest relative error at the points."""
    all_cols = [[batch * x * x for x in xs], [batch * x for x in xs], [1.0 for _ in xs]]
    coef, resid = nonneg_lstsq([all_cols[i] for i in terms], ys)
    out = [0.0, 0.0, 0.0]
    for i, v in zip(terms, coef):
        out[i] = v
    return (out[0], out[1], out[2]), resid


def fit_component(samples: Sequence[Sample], params: int, batch: int, scale: float = 1.0) -> ComponentFit:
    """Fits of one component's samples; ``scale`` stretches the times (an emulated slower device)."""
    xs = [s.seq_len for s in samples]
    f, rf = fit_quadratic(xs, [s.forward_s * scale for s in samples], batch)
    b, rb = fit_quadratic(xs, [s.backward_s * scale for s in samples], batch)
    act, _ = fit_quadratic(xs, [s.activation_bytes for s in samples], batch)
    return ComponentFit(forward_s=f, backward_s=b, activation_bytes=act, params=params,
                        residual=round(max(rf, rb), 4))


def measured_model(model: ModelSpec, raw: dict[int, dict[str, tuple[list[Sample], int]]], micro_batch: int,
                   seq_lens: Sequence[int], scale: float = 1.0) -> MeasuredModel:
    return MeasuredModel(
        hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size, num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads, vocab_size=model.vocab_size, micro_batch=micro_batch,
        seq_lens=tuple(seq_lens),
        tp={t: {name: fit_component(samples, params, micro_batch, scale)
                for name, (samples, params) in comps.items()} for t, comps in raw.items()})


def _step_layout(count: int, numel: int, device: torch.device) -> tuple[dict, dict]:
    """``count`` parameters of ``numel`` elements and gradients for them (name -> tensor)."""
    params = {f"p{i}": torch.zeros(numel, device=device) for i in range(count)}
    grads = {n: torch.full((numel,), 1e-3, device=device) for n in params}
    return params, grads


def measure_optimizer(layouts: Iterable[tuple[int, int]], device: torch.device | str = "cpu",
                      reps: int = 7) -> tuple[OptimizerFit, float]:
    """The runtime's optimizer span (runtime/engine/program.py: gradients scaled by the clip coefficient,
    then AdamW on the local shards, ``LocalAdamW.step``) over ``(tensors, elements each)`` layouts,
    fitted as ``seconds_per_param * params + seconds_per_tensor * tensors + fixed_s``."""
    from runtime.engine.optim import LocalAdamW, clip_coefficient
    from runtime.spec.plan import OptimizerSettings

    device = torch.device(device)
    settings = OptimizerSettings()
    rows: list[tuple[float, float]] = []
    ys = []
    for count, numel in layouts:
        params, grads = _step_layout(count, numel, device)
        opt = LocalAdamW(params, settings)
        norm = torch.tensor(10.0, device=device)
        opt.step(grads, clip_coefficient(norm, 1.0))

        def run(opt: LocalAdamW = opt, grads: dict = grads, norm: torch.Tensor = norm) -> Callable[[], None]:
            return lambda: opt.step(grads, clip_coefficient(norm, 1.0))

        ys.append(_median_time(run, device, min_reps=reps, max_reps=reps, budget_s=0.0))
        rows.append((count * numel, count))
    coef, resid = nonneg_lstsq([[r[0] for r in rows], [r[1] for r in rows], [1.0] * len(rows)], ys)
    return OptimizerFit(seconds_per_param=coef[0], seconds_per_tensor=coef[1], fixed_s=coef[2]), resid


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
    from runtime.engine.optim import LocalAdamW, clip_coefficient
    from runtime.spec.plan import OptimizerSettings

    device = torch.device(device)
    rows: list[tuple[float, float]] = []
    opt_ys: list[float] = []
    over_ys: list[float] = []
    for model in models:
        s = min(seq_len, model.max_seq_len)
        for tp in tp_degrees:
            for embed, head, n in STAGE_VARIANTS.values():
                run = _StageRun(model, tp, n, embed, head, micro_batch, s, device)
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
                    stats = torch.stack([run.loss_sum.float(), norm_sq])
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
    cols = [[r[0] for r in rows], [r[1] for r in rows], [1.0] * len(rows)]
    coef, resid = nonneg_lstsq(cols, opt_ys)
    ocoef, _ = nonneg_lstsq(cols, over_ys)
    return (OptimizerFit(seconds_per_param=coef[0], seconds_per_tensor=coef[1], fixed_s=coef[2]),
            OptimizerFit(seconds_per_param=ocoef[0], seconds_per_tensor=ocoef[1], fixed_s=ocoef[2]), resid)


def measure_sync_pack(models: Sequence[ModelSpec], tp_degrees: Sequence[int], *,
                      device: torch.device | str = "cpu", reps: int = 9) -> OptimizerFit:
    """The local work of the cross-pipeline gradient sync around its all-reduce, as
    runtime/comm/gradsync.py ``GradientSync.sync`` does it: each gradient's slice flattened and
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
    coef, _ = nonneg_lstsq([[r[0] for r in rows], [r[1] for r in rows], [1.0] * len(rows)], ys)
    return OptimizerFit(seconds_per_param=coef[0], seconds_per_tensor=coef[1], fixed_s=coef[2])


def measure_throughput(device: torch.device | str = "cpu") -> dict[str, float]:
    """Model-independent figures: GEMM rate (TFLOPS), copy bandwidth (GB/s), per-op overhead (s)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemm = _median_time(lambda: (lambda: a @ b), device, min_reps=5, max_reps=20, budget_s=0.1)
    size = (256 if device.type == "cuda" else 16) * 2**20 // 4
    src = torch.randn(size, device=device)
    dst = torch.empty_like(src)
    copy = _median_time(lambda: (lambda: dst.copy_(src)), device, min_reps=5, max_reps=20, budget_s=0.1)
    one = torch.ones(1, device=device)
    op = _median_time(lambda: (lambda: [one.add(one) for _ in range(100)]), device, min_reps=5, max_reps=20,
                      budget_s=0.05) / 100
    return {"tflops": 2.0 * n**3 / gemm / 1e12, "bandwidth_gbs": 2.0 * size * 4 / copy / 1e9, "op_s": op}


def p2p_and_allreduce(rank: int, world: int, sizes: Sequence[int], *, device: torch.device | str = "cpu",
                      reps: int = 15) -> dict:
    """Inside an initialised process group of ``world`` ranks: ping-pong between ranks 0 and 1, and an
    all-reduce over groups of 2 and of ``world`` ranks, at each message size. Rank 0 returns
    ``{"p2p": LinkFit, "allreduce": {group size: LinkFit}, "allgather": {group size: LinkFit}}`` (latency
    + bytes / bandwidth; for the all-reduce, bytes = 2(n-1)/n x size; for the all-gather of ``size``
    gathered bytes, as ZeRO-1 gathers its parameter chunks, (n-1)/n x size); the other ranks return {}."""
    import torch.distributed as dist

    device = torch.device(device)
    group_sizes = sorted({2, world}) if world >= 2 else []
    groups = {n: dist.new_group(list(range(n))) if n < world else None for n in group_sizes}

    def timed(fn: Callable[[], None]) -> float:
        times = []
        for _ in range(reps + 2):
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return trimmed_mean(times[2:])

    p2p_x, p2p_y = [], []
    ar: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in group_sizes}
    ag: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in group_sizes}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=device)
        nbytes = buf.numel() * 4

        def one(op: Callable, t: torch.Tensor, peer: int) -> None:
            # As the runtime posts a schedule tick's messages (runtime/engine/pipeline.py P2PBatch).
            for req in dist.batch_isend_irecv([dist.P2POp(op, t, peer)]):
                req.wait()

        def ping(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                one(dist.isend, buf, 1)
                one(dist.irecv, buf, 1)
            elif rank == 1:
                one(dist.irecv, buf, 0)
                one(dist.isend, buf, 0)

        p2p_x.append(nbytes)
        p2p_y.append(timed(ping) / 2)
        for n in group_sizes:
            g = groups[n]
            member = rank < n

            def reduce(g=g, member=member, buf: torch.Tensor = buf) -> None:
                if member:
                    dist.all_reduce(buf, group=g)

            ar[n][0].append(2.0 * (n - 1) / n * nbytes)
            ar[n][1].append(timed(reduce))
            part = max(1, buf.numel() // n)
            gathered = torch.zeros(part * n, device=device)

            def gather(g=g, member=member, gathered: torch.Tensor = gathered, part: int = part) -> None:
                if member:
                    dist.all_gather_into_tensor(gathered, gathered[:part].clone(), group=g)

            ag[n][0].append((n - 1) / n * part * n * 4)
            ag[n][1].append(timed(gather))
    wake = _p2p_wake(rank, device, reps)
    if rank != 0:
        return {}
    return {"p2p": _link_fit(p2p_x, p2p_y), "allreduce": {n: _link_fit(x, y) for n, (x, y) in ar.items()},
            "allgather": {n: _link_fit(x, y) for n, (x, y) in ag.items()}, "p2p_wake": wake}


def _p2p_wake(rank: int, device: torch.device, reps: int,
              idles_s: Sequence[float] = (0.0, 0.0005, 0.002, 0.008)) -> ResumePenalty | None:
    """How much later a process blocked in a receive gets going when it has waited ``t`` (its core idle
    meanwhile): rank 0 sleeps ``t``, then sends to rank 1 (blocked in its receive since it last replied)
    and waits for the reply; the round trip beyond the one at ``t = 0`` is rank 1's extra wake-up time.
    Fitted as ``peak * (1 - exp(-t / tau))`` (``ResumePenalty`` with forward_s = backward_s = peak)."""
    import torch.distributed as dist

    buf = torch.zeros(1024, device=device)
    rtts: list[float] = []
    for idle in idles_s:
        dist.barrier()
        times = []
        for _ in range(reps + 2):
            if rank == 0:
                if idle:
                    time.sleep(idle)
                t0 = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(buf, 1)
                times.append(time.perf_counter() - t0)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        if rank == 0:
            rtts.append(trimmed_mean(times[2:]))
    if rank != 0:
        return None
    (peak,), tau = _fit_saturating(idles_s, [(max(0.0, r - rtts[0]),) for r in rtts])
    return ResumePenalty(forward_s=peak, backward_s=peak, tau_s=tau)


def _link_fit(xs: Sequence[float], ys: Sequence[float]) -> LinkFit:
    fit, _ = fit_quadratic(xs, ys, terms=(1, 2))
    bw = 1.0 / fit[1] / 1e9 if fit[1] > 0 else 1e6
    return LinkFit(latency_s=fit[2], bandwidth_gbs=bw)

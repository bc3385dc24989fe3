"""Timing the runtime's own Llama modules on this machine, per TP shard shape, and fitting the costs.

Each component is built from runtime/models/llama.py with the shapes one TP rank holds (q/k/v and
gate/up split on their outputs, o/down on their inputs, embedding and head on the vocabulary), run
forward and backward on ``B`` sequences of each length ``s``, and timed (median of repeats, after a
warm-up; CUDA synchronised). Saved activations are counted with ``saved_tensors_hooks`` (unique
storages, parameters excluded). Each series is fitted with ``a*s^2 + b*s + c`` by least squares on
relative error, keeping only non-negative coefficients.

What this does not time: the TP collectives and DTensor dispatch (the cost model adds the collectives
from the measured link figures), and the head's all-gather (its output is materialised by a copy).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from runtime.models.llama import LlamaAttention, LlamaMLP, RMSNorm, causal_lm_loss_sum, rope_tables
from runtime.profiling.profile import COMPONENTS, ComponentFit, Fit, LinkFit, MeasuredModel, OptimizerFit
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
    h, kv = model.hidden_size, model.kv_dim
    att.q_proj = nn.Linear(h, h // tp, bias=False)
    att.k_proj = nn.Linear(h, kv // tp, bias=False)
    att.v_proj = nn.Linear(h, kv // tp, bias=False)
    att.o_proj = nn.Linear(h // tp, h, bias=False)
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


def _median_time(run: Callable[[], Callable[[], None]], device: torch.device, *, min_reps: int,
                 max_reps: int, budget_s: float) -> float:
    """Median wall time of the timed part: ``run()`` prepares (untimed) and returns what to time."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        timed = run()
        synchronize(device)
        t0 = time.perf_counter()
        timed()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_forward_backward(comp: _Component | _Runner, args: tuple, device: torch.device,
                           **kw: float) -> tuple[float, float]:
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


def nonneg_lstsq(columns: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[list[float], float]:
    """``y ~ sum_i coef_i * column_i`` by least squares on relative error, every coefficient >= 0: the
    best fit over the subsets of columns whose solution is non-negative (the others are 0). Returns the
    coefficients and the largest relative error at the points."""
    y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
    cols = [torch.tensor([float(v) for v in c], dtype=torch.float64) for c in columns]
    w = 1.0 / torch.clamp(y.abs(), min=1e-30)
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


def measure_optimizer(layouts: Iterable[tuple[int, int]], device: torch.device | str = "cpu",
                      reps: int = 7) -> tuple[OptimizerFit, float]:
    """The runtime's AdamW step over ``(tensors, elements each)`` layouts, fitted as
    ``seconds_per_param * params + seconds_per_tensor * tensors + fixed_s``."""
    from runtime.engine.optim import build_adamw
    from runtime.spec.plan import OptimizerSettings

    device = torch.device(device)
    rows: list[tuple[float, float]] = []
    ys = []
    for count, numel in layouts:
        ps = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(count)]
        for p in ps:
            p.grad = torch.full((numel,), 1e-3, device=device)
        opt = build_adamw(ps, OptimizerSettings())
        opt.step()
        ys.append(_median_time(lambda opt=opt: opt.step, device, min_reps=reps, max_reps=reps, budget_s=0.0))
        rows.append((count * numel, count))
    coef, resid = nonneg_lstsq([[r[0] for r in rows], [r[1] for r in rows], [1.0] * len(rows)], ys)
    return OptimizerFit(seconds_per_param=coef[0], seconds_per_tensor=coef[1], fixed_s=coef[2]), resid


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
                      reps: int = 10) -> dict:
    """Inside an initialised process group of ``world`` ranks: ping-pong between ranks 0 and 1, and an
    all-reduce over groups of 2 and of ``world`` ranks, at each message size. Rank 0 returns
    ``{"p2p": LinkFit, "allreduce": {group size: LinkFit}}`` (latency + bytes / bandwidth; for the
    all-reduce, bytes = 2(n-1)/n x size); the other ranks return {}."""
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
        return statistics.median(times[2:])

    p2p_x, p2p_y = [], []
    ar: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in group_sizes}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=device)
        nbytes = buf.numel() * 4

        def ping(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

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
    if rank != 0:
        return {}
    return {"p2p": _link_fit(p2p_x, p2p_y), "allreduce": {n: _link_fit(x, y) for n, (x, y) in ar.items()}}


class _LocalLayer(nn.Module):
    """One decoder layer with the shapes of one TP rank, without DTensor or collectives."""

    def __init__(self, model: ModelSpec, tp: int) -> None:
        super().__init__()
        from runtime.models.llama import LlamaDecoderLayer

        self.layer = LlamaDecoderLayer(model)
        self.layer.self_attn = _shard_attention(model, tp)
        self.layer.mlp = _shard_mlp(model, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.layer(x, cos, sin)


def measure_tp_overhead(model: ModelSpec, tp: int, group, seq_lens: Sequence[int], *, device: torch.device | str,
                        micro_batch: int = 1, reps: int = 5) -> list[Sample] | None:
    """What tensor parallelism adds to one decoder layer: the runtime's TP layer (DTensor over ``group``,
    its collectives included) minus the same local shard run plainly. Call on every member of ``group``
    (the first ``tp`` ranks); the group's first rank returns the samples, the others None."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from runtime.engine.tensor_parallel import apply_tensor_parallel
    from runtime.models.llama import LlamaForCausalLM
    from runtime.models.params import layer_parameters

    device = torch.device(device)
    mesh = DeviceMesh.from_group(group, device.type)
    stage = LlamaForCausalLM(model, [0], embed=False, head=False).to(device)
    apply_tensor_parallel(stage, layer_parameters(model, 0), mesh)
    tp_layer = stage.model.layers["0"]
    local = _LocalLayer(model, tp).to(device)
    first = dist.get_rank(group) == 0
    out = []
    for s in seq_lens:
        g = torch.Generator(device="cpu").manual_seed(s)
        x = torch.randn(micro_batch, s, model.hidden_size, generator=g).to(device)
        cos, sin = rope_tables(s, model.head_dim, model.rope_theta, device, x.dtype)
        times = {}
        for name, mod in (("tp", tp_layer), ("local", local)):
            comp = _Runner(mod, (x.clone().requires_grad_(), cos, sin), device)
            for _ in range(min(2, reps)):
                comp.backward(comp.forward(comp.args))
            kw = {"min_reps": reps, "max_reps": reps, "budget_s": 0.0}
            if name == "tp":
                dist.barrier(group=group)
            times[name] = _time_forward_backward(comp, comp.args, device, **kw)  # type: ignore[arg-type]
        out.append(Sample(s, max(0.0, times["tp"][0] - times["local"][0]),
                          max(0.0, times["tp"][1] - times["local"][1]), 0.0))
    return out if first else None


class _Runner:
    """``_Component``'s forward/backward protocol for an arbitrary module and fixed inputs."""

    def __init__(self, module: nn.Module, args: tuple, device: torch.device) -> None:
        self.module = module
        self.args = args
        self.device = device

    def forward(self, args: tuple) -> torch.Tensor:
        with autocast(self.device):
            return self.module(*args)

    def backward(self, out: torch.Tensor) -> None:
        out.backward(torch.ones_like(out))


def _link_fit(xs: Sequence[float], ys: Sequence[float]) -> LinkFit:
    fit, _ = fit_quadratic(xs, ys, terms=(1, 2))
    bw = 1.0 / fit[1] / 1e9 if fit[1] > 0 else 1e6
    return LinkFit(latency_s=fit[2], bandwidth_gbs=bw)

"""Cross-device numerics check (H2-style): every model component's forward and backward on each local
device type and dtype, against an fp64 CPU reference with the same weights, inputs and upstream gradient.

Why: a heterogeneous run mixes chips whose kernels round differently; a stage whose kernel is wrong (or
just far less accurate) on one chip silently corrupts training. Relative errors per component show it
before a run does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.models.llama import LlamaAttention, LlamaMLP, RMSNorm, causal_lm_loss_sum, rope_tables
from runtime.torchfree.profiling.profile import COMPONENTS
from runtime.torchfree.spec.model import ModelSpec

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Largest relative error (||y - y_ref|| / ||y_ref||) accepted per dtype, forward and every gradient.
# Rounding alone gives ~1e-7 (fp32), ~4e-3 (bf16, 8-bit mantissa) and ~5e-4 (fp16) per element; a wrong
# kernel (a missing mask, a wrong scale) gives errors of order 0.1-1. Measured on the CPU with llama-tiny
# (seq 32 and 128), the worst components reach 7e-7 (fp32), 1.2e-2 (bf16) and 1.5e-3 (fp16): the bounds
# leave >= 3x headroom. (The runtime's loss upcasts logits to fp32, so the head's reference loss is only
# fp32-exact: far below every bound here.)
TOLERANCES: dict[str, float] = {"fp32": 1e-4, "bf16": 4e-2, "fp16": 5e-3}

# A kernel: how a component's module is run on its inputs. The check runs the same kernel in fp64 on
# the CPU as the reference, unless a different one is given for the devices under test.
Kernel = Callable[[nn.Module, tuple], torch.Tensor]


class _HeadLoss(nn.Module):
    """Final norm, output projection and mean token loss: what the last pipeline stage adds."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss_sum(self.lm_head(self.norm(x)), labels) / labels.numel()


def _builders(spec: ModelSpec) -> dict[str, Callable[[], nn.Module]]:
    return {
        "embedding": lambda: nn.Embedding(spec.vocab_size, spec.hidden_size),
        "attention": lambda: LlamaAttention(spec),
        "mlp": lambda: LlamaMLP(spec),
        "norm": lambda: RMSNorm(spec.hidden_size, spec.norm_eps),
        "head": lambda: _HeadLoss(spec),
    }


def _call(module: nn.Module, args: tuple) -> torch.Tensor:
    return module(*args)


STOCK_KERNELS: dict[str, Kernel] = {name: _call for name in COMPONENTS}


@dataclass(frozen=True)
class Result:
    """One component on one device type and dtype."""

    device: str
    dtype: str
    component: str
    forward_error: float
    backward_error: float      # the worst of the input gradient and every parameter gradient
    worst_gradient: str        # which gradient that was
    tolerance: float

    @property
    def flagged(self) -> bool:
        return not (self.forward_error <= self.tolerance and self.backward_error <= self.tolerance)

    def to_json(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "component": self.component,
                "forward_rel_error": self.forward_error, "backward_rel_error": self.backward_error,
                "worst_gradient": self.worst_gradient, "tolerance": self.tolerance, "flagged": self.flagged}


@dataclass(frozen=True)
class NumericsSettings:
    batch: int = 2
    seq_len: int = 32
    seed: int = 0
    tolerances: Mapping[str, float] = field(default_factory=lambda: dict(TOLERANCES))

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq_len < 2:
            raise ValueError("batch must be at least 1 and seq_len at least 2")


MAX_ELEMENTS = 2**28  # per tensor: the fp64 reference of a 2**28-element head alone is 2 GiB, its gradient 2 more


def size_problem(spec: ModelSpec, settings: NumericsSettings) -> str | None:
    """Why this model's components are too large to check on this machine in fp64, or None."""
    tokens = settings.batch * settings.seq_len
    largest = {"the embedding / head weight": spec.vocab_size * spec.hidden_size,
               "an MLP weight": spec.hidden_size * spec.ffn_hidden_size,
               "the head's logits": tokens * spec.vocab_size,
               "the MLP's activations": tokens * spec.ffn_hidden_size,
               # head_dim 10**6 on llama-tiny's 8 heads: 5e8-element q/o projections, allocated for minutes
               "an attention projection": spec.hidden_size * spec.num_heads * spec.head_size,
               "the attention scores": settings.batch * spec.num_heads * settings.seq_len ** 2}
    what, n = max(largest.items(), key=lambda kv: kv[1])
    if n > MAX_ELEMENTS:
        return (f"{spec.name}: {what} has {n:,} elements, more than the {MAX_ELEMENTS:,} checked in fp64 here "
                "(use a model of the same kind with smaller sizes, or a shorter --seq-len)")
    return None


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64 = a.detach().to("cpu", torch.float64)
    num = torch.linalg.vector_norm(a64 - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else num


def _inputs(name: str, spec: ModelSpec, s: NumericsSettings) -> tuple[tuple, torch.Tensor | None]:
    """fp64 CPU inputs (token ids stay integers) and the upstream gradient for non-scalar outputs."""
    g = torch.Generator().manual_seed(s.seed + 1)
    b, n, h = s.batch, s.seq_len, spec.hidden_size
    if name == "embedding":
        args: tuple = (torch.randint(0, spec.vocab_size, (b, n), generator=g),)
        return args, torch.randn(b, n, h, generator=g, dtype=torch.float64)
    x = torch.randn(b, n, h, generator=g, dtype=torch.float64)
    if name == "head":
        return (x, torch.randint(0, spec.vocab_size, (b, n), generator=g)), None
    cpu = torch.device("cpu")
    rope = rope_tables(n, spec.head_dim, spec.rope_theta, cpu, torch.float64) if name == "attention" else ()
    return (x, *rope), torch.randn(b, n, h, generator=g, dtype=torch.float64)


def _weights(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """fp64 weights: N(0, 1/sqrt(fan_in)) matrices (activations of order one), norms near one."""
    g = torch.Generator().manual_seed(seed)
    return {name: 1.0 + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64) if p.dim() == 1
            else torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[-1])
            for name, p in module.named_parameters()}


def _run(module: nn.Module, kernel: Kernel, args64: tuple, grad64: torch.Tensor | None,
         device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward in ``dtype`` on ``device``: the output and every gradient (fp64, CPU)."""
    module = module.to(device=device, dtype=dtype)
    args = []
    for a in args64:
        if a.is_floating_point():
            a = a.to(device=device, dtype=dtype, copy=True)  # a fresh leaf for every run
            if a.dim() == 3:  # the hidden-state input; rotary tables are constants
                a.requires_grad_()
        else:
            a = a.to(device)
        args.append(a)
    out = kernel(module, tuple(args))
    out.backward(None if grad64 is None else grad64.to(device=device, dtype=out.dtype))
    grads = {f"d{n}": p.grad for n, p in module.named_parameters()}
    if args[0].is_floating_point():
        grads = {"dinput": args[0].grad, **grads}
    return (out.detach().to("cpu", torch.float64),
            {k: v.detach().to("cpu", torch.float64) for k, v in grads.items()})


def local_devices() -> list[str]:
    """The device types this machine can run: the CPU, and CUDA when a GPU is visible."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def check_numerics(spec: ModelSpec, devices: Sequence[str], dtypes: Sequence[str],
                   settings: NumericsSettings = NumericsSettings(), *,
                   kernels: Mapping[str, Kernel] | None = None,
                   components: Sequence[str] = COMPONENTS) -> list[Result]:
    """Relative error of each component, device and dtype against the fp64 CPU reference.

    ``kernels``: a different kernel for some components on the devices under test (the reference keeps
    the stock one); this is how a wrong or suspect kernel is checked.
    """
    under_test = {**STOCK_KERNELS, **(kernels or {})}
    builders = _builders(spec)
    results: list[Result] = []
    for ci, name in enumerate(components):
        weights = _weights(builders[name](), settings.seed * 1000 + ci)
        args64, grad64 = _inputs(name, spec, settings)
        ref = builders[name]().to(torch.float64)
        ref.load_state_dict(weights)
        ref_out, ref_grads = _run(ref, STOCK_KERNELS[name], args64, grad64, torch.device("cpu"), torch.float64)
        for dev in devices:
            for dt in dtypes:
                tested = builders[name]()
                tested.load_state_dict(weights)  # copies (and rounds) the fp64 weights into fp32 first
                out, grads = _run(tested, under_test[name], args64, grad64, torch.device(dev), DTYPES[dt])
                errs = {k: _rel(v, ref_grads[k]) for k, v in grads.items()}
                worst = max(errs, key=lambda k: errs[k])
                results.append(Result(dev, dt, name, _rel(out, ref_out), errs[worst], worst,
                                      settings.tolerances[dt]))
    return results

"""Fitting ``hspmd profile``'s samples: ``a*s^2 + b*s + c`` by least squares on relative error with
non-negative coefficients, links as latency + bytes / bandwidth. Importing this loads no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.torchfree.profiling.profile import ComponentFit, Fit, LinkFit, MeasuredModel, OptimizerFit
from runtime.torchfree.spec.model import ModelSpec


@dataclass(frozen=True)
class Sample:
    """One timed point of a block: forward and backward seconds and saved bytes at one length."""

    seq_len: int
    forward_s: float
    backward_s: float
    activation_bytes: float


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
    import torch

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
            found = dict(zip(subset, sol.tolist()))
            coef = [found.get(i, 0.0) for i in range(len(cols))]
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
    out = dict(zip(terms, coef))
    return (out.get(0, 0.0), out.get(1, 0.0), out.get(2, 0.0)), resid


def link_fit(xs: Sequence[float], ys: Sequence[float]) -> LinkFit:
    fit, _ = fit_quadratic(xs, ys, terms=(1, 2))
    bw = 1.0 / fit[1] / 1e9 if fit[1] > 0 else 1e6
    return LinkFit(latency_s=fit[2], bandwidth_gbs=bw)


def fit_per_param(rows: Sequence[tuple[float, float]], ys: Sequence[float]) -> tuple[OptimizerFit, float]:
    """``seconds_per_param * params + seconds_per_tensor * tensors + fixed_s`` over (params, tensors) rows,
    and its largest relative error."""
    coef, resid = nonneg_lstsq([[r[0] for r in rows], [r[1] for r in rows], [1.0] * len(rows)], ys)
    return OptimizerFit(seconds_per_param=coef[0], seconds_per_tensor=coef[1], fixed_s=coef[2]), resid


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
        architecture=model.architecture, seq_lens=tuple(seq_lens),
        tp={t: {name: fit_component(samples, params, micro_batch, scale)
                for name, (samples, params) in comps.items()} for t, comps in raw.items()})


def rounded(x: float) -> float:
    """Five significant digits: what a profile keeps of a measured figure."""
    return float(f"{x:.5g}") if math.isfinite(x) else x

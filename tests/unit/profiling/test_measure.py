"""The profiler's pieces in-process: fitting, timing the runtime's modules, choosing what to measure."""

from __future__ import annotations

import pytest
import torch

from runtime.errors import InfeasibleError
from runtime.profiling.measure import fit_component, fit_quadratic, measure_component, nonneg_lstsq
from runtime.profiling.profiler import plan_targets
from runtime.spec import load_cluster, load_model

TINY = load_model("llama-tiny")


def test_fit_recovers_known_quadratic():
    xs = [16, 32, 64, 128]
    (a, b, c), resid = fit_quadratic(xs, [2e-9 * x * x + 3e-7 * x + 5e-5 for x in xs])
    assert (a, b, c) == pytest.approx((2e-9, 3e-7, 5e-5), rel=1e-6)
    assert resid < 1e-9
    # Per-sequence terms scale with the batch, the constant does not.
    (a2, b2, c2), _ = fit_quadratic(xs, [4 * (2e-9 * x * x + 3e-7 * x) + 5e-5 for x in xs], batch=4)
    assert (a2, b2, c2) == pytest.approx((2e-9, 3e-7, 5e-5), rel=1e-6)


def test_fit_never_negative():
    # A decreasing series would want a negative slope: the fit keeps coefficients >= 0 instead.
    (a, b, c), resid = fit_quadratic([1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0])
    assert min(a, b, c) >= 0 and resid > 0
    coef, _ = nonneg_lstsq([[1, 2, 3], [1, 1, 1]], [3.0, 5.0, 7.0])
    assert coef == pytest.approx([2.0, 1.0])


def test_measure_runtime_modules_per_shard():
    torch.manual_seed(0)
    samples, params = measure_component("attention", TINY, 2, [16, 32], min_reps=2, max_reps=3, budget_s=0.0,
                                        warmup=1)
    h, kv = TINY.hidden_size, TINY.kv_dim
    assert params == (h * h + 2 * kv * h + h * h) // 2            # q, k, v, o of one TP-2 rank
    assert [s.seq_len for s in samples] == [16, 32]
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in samples)
    assert samples[1].activation_bytes > samples[0].activation_bytes > 0
    samples, params = measure_component("head", TINY, 1, [16, 32], min_reps=2, max_reps=3, budget_s=0.0, warmup=1)
    assert params == TINY.vocab_size * h
    fit = fit_component(samples, params, batch=1, scale=3.0)
    plain = fit_component(samples, params, batch=1)
    assert fit.forward_s == pytest.approx(tuple(3 * v for v in plain.forward_s))
    assert fit.activation_bytes == plain.activation_bytes      # a slower device holds the same tensors


def test_plan_targets():
    (t,) = plan_targets(load_cluster("cpu-hetero4"), [TINY], None)
    assert t.device == "cpu" and t.types == {"cpu-fast": 1.0, "cpu-slow": 3.0}
    assert t.tp_degrees == (1, 2) and t.local_devices == 4
    with pytest.raises(InfeasibleError, match="--device-type"):
        plan_targets(load_cluster("hexiscale-mixed"), [TINY], None, cuda_available=False)
    with pytest.raises(InfeasibleError, match="no CUDA GPU"):
        plan_targets(load_cluster("h20-32"), [TINY], "H20", cuda_available=False)
    (g,) = plan_targets(load_cluster("h20-32"), [load_model("llama-32b")], "H20", cuda_available=True)
    assert g.device == "cuda:0" and g.tp_degrees == (1, 2, 4, 8)

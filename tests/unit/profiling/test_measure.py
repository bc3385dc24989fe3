"""The profiler's pieces in-process: fitting, timing the runtime's modules, choosing what to measure."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hetu_cli.emulation import cpu_shares, profiler_cpus
from runtime.models.llama import LlamaForCausalLM, causal_lm_loss_sum
from runtime.profiling.compute import (
    StageRun,
    local_stage,
    measure_component,
    measure_split_blocks,
    measure_stage_blocks,
    measure_step_epilogue,
    measure_sync_pack,
    stage_blocks,
    time_back_to_back,
    tp_overhead_blocks,
)
from runtime.profiling.fit import fit_component, fit_quadratic, nonneg_lstsq
from runtime.profiling.host import WorkerCpus, host_cpus
from runtime.profiling.profiler import plan_targets
from runtime.torchfree.errors import InfeasibleError
from runtime.torchfree.profiling.profile import BLOCKS, SPLIT_BLOCKS
from runtime.torchfree.spec import load_cluster, load_model

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
    # A slower device holds the same tensors: the scale does not enter the activation fit. To rounding, not to
    # the bit: two fits of these same samples can come out 26.83333333333334 and ...35, torch.linalg.lstsq's
    # LAPACK/BLAS path not being bit-reproducible from call to call.
    assert fit.activation_bytes == pytest.approx(plain.activation_bytes, rel=1e-12, abs=0.0)


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


def test_stage_blocks_are_differences_of_whole_stages():
    med = {"mid1": (3.0, 5.0), "mid3": (7.0, 11.0), "first1": (3.5, 5.25), "last1": (4.0, 5.0)}
    blocks = stage_blocks(med)
    assert blocks["layer"] == pytest.approx((2.0, 3.0))             # (3 layers - 1) / 2
    assert blocks["stage"] == pytest.approx((1.0, 2.0))             # 1 layer minus a layer
    assert blocks["embedding"] == pytest.approx((0.5, 0.25)) and blocks["head"] == pytest.approx((1.0, 0.0))
    assert stage_blocks({**med, "mid3": (2.0, 1.0)})["layer"] == (0.0, 0.0)   # noise never goes below zero


def test_tp_overhead_is_the_difference_of_whole_tp_and_local_stages():
    """Hand-computed: the TP stages minus the local ones per variant, then the blocks of those differences;
    a TP stage measured faster than its local shards (noise) adds nothing."""
    local = {"mid1": (3.0, 5.0), "mid3": (7.0, 11.0), "first1": (3.5, 5.25), "last1": (4.0, 5.0)}
    tp = {"mid1": (4.0, 7.0), "mid3": (10.0, 17.0), "first1": (5.0, 7.5), "last1": (6.0, 6.5)}
    blocks = tp_overhead_blocks(tp, local)
    # differences: mid1 (1, 2), mid3 (3, 6), first1 (1.5, 2.25), last1 (2, 1.5)
    assert blocks["layer"] == pytest.approx((1.0, 2.0))        # (3 - 1) / 2, (6 - 2) / 2
    assert blocks["stage"] == pytest.approx((0.0, 0.0))        # mid1's difference minus a layer's
    assert blocks["embedding"] == pytest.approx((0.5, 0.25))   # first1's minus mid1's
    assert blocks["head"] == pytest.approx((1.0, 0.0))         # last1's minus mid1's (-0.5: none)
    faster = tp_overhead_blocks({**tp, "mid3": (6.0, 17.0)}, local)
    assert faster["layer"] == pytest.approx((0.0, 2.0)) and faster["stage"] == pytest.approx((1.0, 0.0))


class _Recorded:
    """A stand-in for ``StageRun`` that logs its calls and sleeps ``secs`` in its forward and backward."""

    def __init__(self, name: str, log: list[str], secs: float) -> None:
        self.name, self.log, self.secs = name, log, secs

    def prepare_forward(self):
        self.log.append(f"{self.name}.prep")
        return self.forward

    def forward(self) -> None:
        self.log.append(f"{self.name}.F")
        time.sleep(self.secs)

    def prepare_backward(self):
        self.prepare_forward()
        self.forward()
        return self.backward

    def backward(self) -> None:
        self.log.append(f"{self.name}.B")
        time.sleep(2 * self.secs)


def test_back_to_back_timing_runs_each_stage_as_the_engine_runs_a_step():
    """Each run's micro-batches, forward then backward, back to back; the runs take turns, one burst each
    per round, with the barrier only before a burst; means per micro-batch, sleeping taking no CPU."""
    log: list[str] = []
    runs = {"a": _Recorded("a", log, 0.002), "b": _Recorded("b", log, 0.001)}
    times = time_back_to_back(runs, torch.device("cpu"), micro_batches=3, rounds=2, warmup=1,
                              barrier=lambda: log.append("barrier"))
    step = {n: ["barrier"] + [f"{n}.prep", f"{n}.F", f"{n}.B"] * 3 for n in "ab"}
    assert log == ["a.prep", "a.F", "a.B", "b.prep", "b.F", "b.B"] + 2 * (step["a"] + step["b"])
    (wall_f, wall_b), (cpu_f, cpu_b) = times["a"]
    assert 0.002 <= wall_f < 0.05 and 0.004 <= wall_b < 0.1
    assert cpu_f < wall_f and cpu_b < wall_b
    assert times["b"][0][0] >= 0.001 and times["b"][0][1] >= 0.002


def test_measure_stage_blocks_through_the_runtime_stage_module():
    torch.manual_seed(0)
    samples = measure_stage_blocks(TINY, 2, [16, 32], min_reps=7, max_reps=7, budget_s=0.0, warmup=1)
    assert sorted(samples) == sorted(BLOCKS)
    assert [s.seq_len for s in samples["layer"]] == [16, 32]
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in samples["layer"])
    # At TP 1 the stage is exactly the module a worker builds; at TP 2 its shards have the local shapes.
    assert isinstance(local_stage(TINY, 1, 2, True, True), LlamaForCausalLM)
    tp2 = local_stage(TINY, 2, 1, True, True)
    assert tp2.model.layers["0"].mlp.gate_proj.weight.shape == (TINY.ffn_hidden_size // 2, TINY.hidden_size)


def test_measure_split_blocks_runs_the_engines_split_backward():
    torch.manual_seed(0)
    samples = measure_split_blocks(TINY, 1, [16, 64], min_reps=5, max_reps=5, budget_s=0.0, warmup=1)
    assert sorted(samples) == sorted(SPLIT_BLOCKS)
    assert [s.seq_len for s in samples["layer"]] == [16, 64]
    # a layer has an input gradient (B) and weight gradients (W); noise never goes below zero
    assert all(s.forward_s > 0 and s.backward_s > 0 for s in samples["layer"])
    assert all(s.forward_s >= 0 and s.backward_s >= 0 for smp in samples.values() for s in smp)


def test_epilogue_and_sync_pack_fits_are_non_negative():
    opt, over, resid = measure_step_epilogue([TINY], [1], reps=2, seq_len=16)
    pack = measure_sync_pack([TINY], [1], reps=2)
    for f in (opt, over, pack):
        assert min(f.seconds_per_param, f.seconds_per_tensor, f.fixed_s) >= 0
    assert opt.seconds_per_param * 1e5 + opt.seconds_per_tensor * 10 + opt.fixed_s > 0 and resid >= 0


def test_emulated_cpu_shares_pin_like_the_launcher():
    # 2 cores, a 4-device cluster: 1 thread each, device i of the plan on core i % 2.
    assert cpu_shares([0, 1, 2, 3], 4, [0, 1]) == WorkerCpus(1, {0: (0,), 1: (1,), 2: (0,), 3: (1,)})
    # The plan's devices in id order, whichever ids: two devices get both cores even if both ids are even.
    assert cpu_shares([2, 0], 4, [0, 1]) == WorkerCpus(1, {0: (0,), 2: (1,)})
    # 16 cores: 4 threads each on cores of their own, the same for a 2-device plan of the same cluster.
    assert cpu_shares([1, 3], 4, list(range(16))) == WorkerCpus(4, {1: (0, 1, 2, 3), 3: (4, 5, 6, 7)})
    # The profiler measures with the share the CLI gives it: the cluster's devices'.
    share = profiler_cpus(load_cluster("cpu-hetero4"))
    assert share == cpu_shares(range(4), 4, host_cpus())
    (t,) = plan_targets(load_cluster("cpu-hetero4"), [TINY], None, cpus=share)
    assert t.threads == share.threads and t.cpus == tuple(share.cpus[i] for i in range(4))
    assert profiler_cpus(load_cluster("h20-32")) is None


def test_a_run_gets_its_workers_share_from_the_harness():
    from hetu_cli.emulation import emulated
    from runtime.launch.launcher import prepare
    from runtime.launch.options import TrainOptions
    from runtime.launch.supervise import PlainPolicy

    plan = Path(__file__).resolve().parents[3] / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
    options = emulated(TrainOptions(plan=plan))
    prep = prepare(options, PlainPolicy())
    assert (prep.threads, prep.cpus) == (options.worker_cpus.threads, dict(options.worker_cpus.cpus))
    assert set(prep.cpus) == set(prep.devices)
    assert prepare(TrainOptions(plan=plan), PlainPolicy()).cpus == {}   # not given: not pinned


def test_stage_run_times_the_engines_micro_batch_step():
    """The profiler's stage run is the engine's step: a middle stage hands back the input gradient of the
    received output gradient, a last stage sums the loss and scales it by the step's tokens."""
    torch.manual_seed(0)
    mid = StageRun(TINY, 1, 1, False, False, 2, 16, torch.device("cpu"))
    mid.prepare_backward()()
    x = mid.x.clone().requires_grad_()
    (want,) = torch.autograd.grad(mid.module(x), x, mid.grad)
    assert torch.allclose(mid.state.grads_out[0], want) and not mid.state.outputs
    last = StageRun(TINY, 1, 1, False, True, 2, 16, torch.device("cpu"))
    last.prepare_forward()()
    loss = causal_lm_loss_sum(last.module(last.x), last.rows[:, 1:])
    assert torch.allclose(last.state.loss_sum, loss) and torch.allclose(last.state.outputs[0], loss / last.tokens)


def test_host_policy_loads_no_torch():
    """The launcher's CPU-share policy is read by torch-free verbs."""
    code = "import sys, runtime.profiling.host; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "False"

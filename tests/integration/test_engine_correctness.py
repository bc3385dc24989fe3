"""Every plan trains exactly like the single-process reference: losses, global grad norm, parameters.

One 8-process gloo world serves the whole module (tests/integration/engine_world.py); the reference is
computed here, in the test process, from the same initial weights and batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_world import DeviceResult, EngineWorld, saved_activation_job
from oracles import optimizer_state

from runtime.checkpoint import read_saved
from runtime.engine.reference import ReferenceTrainer
from runtime.torchfree.models.params import llama_parameters
from runtime.torchfree.spec import PlanContext, load_plan_context

PLANS = Path(__file__).parent / "engine_plans"
STEPS = 3
RTOL = 1e-5
# Absolute floor for parameter entries near zero, as a fraction of one Adam step (lr = 1e-3 in every
# test plan). Adam divides by sqrt(v) + eps, so an entry whose gradient is within fp32 rounding noise of
# zero moves by up to lr * noise / eps: rounding differences (another summation order in a TP
# all-reduce, another micro-batch size) are amplified by lr / eps. The test plans use eps 1e-5 to keep
# that below 1e-3 of a step; with eps 1e-8 even two correct single-device runs (whole batch vs
# micro-batched) differ by ~1e-2 of a step after 3 steps. A wrong gradient moves entries by O(lr).
ATOL_STEPS = 1e-3  # x lr


@pytest.fixture(scope="module")
def world():
    w = EngineWorld(8)
    yield w
    w.close()


def make_batches(ctx: PlanContext, steps: int = STEPS) -> list[torch.Tensor]:
    t = ctx.plan.training
    g = torch.Generator().manual_seed(20240611)
    return [torch.randint(0, ctx.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=g)
            for _ in range(steps)]


def assemble(results: dict[int, DeviceResult], key: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full tensor from the primary shards; every other copy must agree with it."""
    full = torch.full(shape, float("nan"))
    copies = []
    for r in results.values():
        if name not in r.regions:
            continue
        idx = tuple(slice(a, b) for a, b in r.regions[name])
        if r.primary[name]:
            full[idx] = torch.from_numpy(r.state[key])
        copies.append((idx, torch.from_numpy(r.state[key]), r.device))
    assert not torch.isnan(full).any(), f"{key}: primary shards do not cover the tensor"
    for idx, local, dev in copies:
        torch.testing.assert_close(local, full[idx], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=key, d=dev: f"{k}: device {d}'s copy differs: {m}")
    return full


def assemble_moment(results: dict[int, DeviceResult], key: str, name: str, shape: tuple[int, ...],
                    copies: int = 1) -> torch.Tensor:
    """A moment from its shards: ZeRO-1 pieces (each element kept by exactly ``copies`` devices, which
    agree) or, for parameters no device shards, the parameter's layout (``assemble``)."""
    if not any(name in r.moment_pieces for r in results.values()):
        return assemble(results, key, name, shape)
    full = torch.zeros(shape).reshape(-1)
    count = torch.zeros(shape, dtype=torch.int64).reshape(-1)
    index = torch.arange(full.numel()).reshape(shape)
    for r in results.values():
        if name not in r.regions:
            continue
        assert name in r.moment_pieces, f"{key}: device {r.device} keeps it unsharded"
        flat, off = torch.from_numpy(r.state[key]), 0
        for region, a, b in r.moment_pieces.get(name, ()):
            where = index[tuple(slice(x, y) for x, y in region)].reshape(-1)[a:b]
            seen = count[where] > 0
            torch.testing.assert_close(flat[off:off + b - a][seen], full[where][seen], rtol=1e-6, atol=1e-9,
                                       msg=lambda m, k=key, d=r.device: f"{k}: device {d}'s copy differs: {m}")
            full[where] = flat[off:off + b - a]
            count[where] += 1
            off += b - a
        assert off == flat.numel(), f"{key}: device {r.device} keeps {flat.numel()} elements, its pieces {off}"
    assert bool((count == copies).all()), \
        f"{key}: ZeRO-1 pieces cover some elements {int(count.min())}-{int(count.max())} x, not {copies} x"
    return full.reshape(shape)


def check_against_reference(plan: Path, results: dict[int, DeviceResult], batches: list[torch.Tensor], *,
                            ref: ReferenceTrainer | None = None, steps: int = STEPS, copies: int = 1) -> None:
    """``results`` of ``batches`` equal the reference's (a fresh one, or ``ref`` continued)."""
    ctx = load_plan_context(plan)
    fresh = ref is None
    ref = ref if ref is not None else ReferenceTrainer(ctx.model, ctx.plan.training)
    ref_stats = [ref.train_step(b) for b in batches]
    devices = ctx.plan.strategies[0].devices
    assert sorted(results) == sorted(devices)
    for dev, r in results.items():
        torch.testing.assert_close(torch.tensor(r.losses, dtype=torch.float64),
                                   torch.tensor([s.loss for s in ref_stats], dtype=torch.float64),
                                   rtol=RTOL, atol=0, msg=lambda m, d=dev: f"losses on device {d}: {m}")
        torch.testing.assert_close(torch.tensor(r.grad_norms, dtype=torch.float64),
                                   torch.tensor([s.grad_norm for s in ref_stats], dtype=torch.float64),
                                   rtol=RTOL, atol=0, msg=lambda m, d=dev: f"grad norms on device {d}: {m}")
        assert float(r.state["step"]) == steps
        check_spans(ctx, r)
    moments = optimizer_state(ref)
    atol = ATOL_STEPS * ctx.plan.training.optimizer.lr
    for name, p in ref.parameters().items():
        got = assemble(results, name, name, tuple(p.shape))
        torch.testing.assert_close(got, p, rtol=RTOL, atol=atol, msg=lambda m, n=name: f"parameter {n}: {m}")
        for key in ("exp_avg", "exp_avg_sq"):
            want = moments[f"{name}.{key}"]
            got = assemble_moment(results, f"{name}.{key}", name, tuple(p.shape), copies)
            # Moments are sums of gradients: entries that cancel to near zero carry rounding noise
            # relative to the tensor's scale, hence an absolute floor of RTOL x its largest entry.
            torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()),
                                       msg=lambda m, n=name, k=key: f"{n}.{k}: {m}")
    # The reference really moved: a plan that skipped the update would not pass by accident.
    if fresh:
        init = ReferenceTrainer(ctx.model, ctx.plan.training).parameters()
        assert any(not torch.allclose(init[n], p, rtol=RTOL, atol=atol) for n, p in ref.parameters().items())


def check_spans(ctx: PlanContext, r: DeviceResult) -> None:
    """The hooks saw each forward/backward block (each chunk's; split into input and weight gradients
    under zero-bubble schedules), the optimizer and the comm ops that describe() lists."""
    role = r.description["role"]
    computes = [n for k, n in r.spans if k == "compute"]
    ops = role["micro_batches"] * len(role["chunks"])
    split = computes.count("input_grad") > 0
    assert computes.count("forward") == ops
    assert (computes.count("input_grad"), computes.count("weight_grad"), computes.count("backward")) == (
        (ops, ops, 0) if split else (0, 0, ops))
    assert computes[-1] == "optimizer"
    comms = [n for k, n in r.spans if k == "comm"]
    p2p = [o["name"] for o in r.description["ops"] if o["kind"] == "comm" and o["name"].startswith(("post ", "wait "))]
    assert [n for n in comms if n.startswith(("post ", "wait "))] == p2p  # the schedule's order, as described
    syncs = any(o["name"].startswith("grad all-reduce") for o in r.description["ops"])
    gathers = any(o["name"].startswith("param all-gather") for o in r.description["ops"])  # ZeRO-1
    assert gathers == ("param_all_gather" in comms)
    # + grad sync, stats, ZeRO-1 all-gather, the routers' loads (aux-loss-free balancing across devices)
    loads = comms.count("router_loads")
    assert loads <= 1
    assert len(comms) == len(p2p) + syncs + (len(ctx.plan.strategies[0].devices) > 1) + gathers + loads
    assert r.compute_s > 0 and (r.comm_s > 0) == (len(ctx.plan.strategies[0].devices) > 1)


CASES = [
    ("single.yaml", None),
    ("dp-uneven.yaml", None),
    ("pp-uneven.yaml", None),
    ("pp-uneven.yaml", "gpipe"),
    ("tp2-tp1.yaml", None),
    ("two-pipelines.yaml", None),
    ("three-pipelines.yaml", None),
    ("three-pipelines.yaml", "gpipe"),
]


@pytest.mark.parametrize("plan,schedule", CASES, ids=[f"{p.removesuffix('.yaml')}-{s or '1f1b'}" for p, s in CASES])
def test_plan_matches_single_device_reference(world: EngineWorld, plan: str, schedule: str | None) -> None:
    path = PLANS / plan
    batches = make_batches(load_plan_context(path))
    results = world.train(str(path), batches, schedule)
    check_against_reference(path, results, batches)


# ZeRO-1 (training.zero: true): the same plans with AdamW moments sharded over the pipelines.
ZERO_PLANS = ["dp-uneven.yaml", "two-pipelines.yaml", "three-pipelines.yaml"]


@pytest.mark.parametrize("plan", ZERO_PLANS, ids=[p.removesuffix(".yaml") for p in ZERO_PLANS])
def test_zero1_plan_matches_single_device_reference(world: EngineWorld, plan: str) -> None:
    path = PLANS / plan
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, zero=True)
    check_against_reference(path, results, batches)
    check_zero_memory(ctx, results)


def test_zero1_with_two_copies_matches_single_device_reference(world: EngineWorld) -> None:
    """zero_redundancy 2: every moment element kept by two devices, each updating it, the all-gather
    sending it once; training is still exactly the reference's."""
    path = PLANS / "three-pipelines.yaml"
    ctx = load_plan_context(path)
    batches = make_batches(ctx)
    results = world.train(str(path), batches, zero=True, redundancy=2)
    check_against_reference(path, results, batches, copies=2)
    model_numel = sum(info.numel for info in llama_parameters(ctx.model))
    assert sum(r.moment_numel for r in results.values()) == 2 * model_numel
    # Device 3 (a whole pipeline) keeps moments only where place() chose it among the k replicas.
    for r in results.values():
        local = sum(v.size for k, v in r.state.items() if k in r.regions)
        assert r.moment_numel <= local, r.device
    assert results[3].moment_numel < sum(v.size for k, v in results[3].state.items() if k in results[3].regions)


def check_zero_memory(ctx: PlanContext, results: dict[int, DeviceResult]) -> None:
    """Every parameter is held by >= 2 pipelines here, so every moment element lives on one device only:
    the devices together keep exactly one copy, and each keeps less than its parameters' size."""
    model_numel = sum(info.numel for info in llama_parameters(ctx.model))
    assert sum(r.moment_numel for r in results.values()) == model_numel
    for r in results.values():
        local = sum(v.size for k, v in r.state.items() if k in r.regions)
        pieces = sum(b - a for ps in r.moment_pieces.values() for _, a, b in ps)
        assert set(r.moment_pieces) == set(r.regions) and r.moment_numel == pieces
        # Each slice is shared by at least two devices: at most about half of the local elements.
        assert r.moment_numel <= local // 2 + sum(len(ps) for ps in r.moment_pieces.values()), (r.device, local)
        assert any(o["name"].startswith("param all-gather") for o in r.description["ops"])


def test_zero1_checkpoints_cross_plans(world: EngineWorld, tmp_path: Path) -> None:
    """Saved under ZeRO-1 (pure DP), continued without it (three pipelines mixing TP and PP), saved again
    and continued under ZeRO-1: every stretch equals the reference continued, moments included."""
    dp, hetero = PLANS / "dp-uneven.yaml", PLANS / "three-pipelines.yaml"
    ctx_dp, ctx_hetero = load_plan_context(dp), load_plan_context(hetero)
    assert ctx_dp.plan.training.optimizer == ctx_hetero.plan.training.optimizer  # one reference serves both
    ref = ReferenceTrainer(ctx_dp.model, ctx_dp.plan.training)
    first, second = tmp_path / "zero", tmp_path / "plain"
    batches = make_batches(ctx_dp, 2)
    check_against_reference(dp, world.train(str(dp), batches, zero=True, save_dir=str(first)), batches, ref=ref,
                            steps=2)
    check_saved(first, ref, 2)
    batches = make_batches(ctx_hetero, 1)
    results = world.train(str(hetero), batches, zero=False, load_dir=str(first), save_dir=str(second), first_step=3)
    check_against_reference(hetero, results, batches, ref=ref, steps=3)
    check_saved(second, ref, 3)
    batches = make_batches(ctx_dp, 1)
    results = world.train(str(dp), batches, zero=True, load_dir=str(second), first_step=4)
    check_against_reference(dp, results, batches, ref=ref, steps=4)


def check_saved(directory: Path, ref: ReferenceTrainer, step: int) -> None:
    """The checkpoint holds the reference's full parameters and moments after ``step`` steps."""
    saved, meta = read_saved(directory)
    assert meta["step"] == str(step)
    want = {**ref.parameters(), **optimizer_state(ref), **ref.router_biases()}
    assert set(saved) == set(want)
    atol = ATOL_STEPS * ref.training.optimizer.lr
    for name, w in want.items():
        tol = RTOL * float(w.abs().max()) if name.endswith(("exp_avg", "exp_avg_sq")) else atol
        torch.testing.assert_close(saved[name], w, rtol=RTOL, atol=tol, msg=lambda m, n=name: f"saved {n}: {m}")


# Sequence parallelism (training.sequence_parallel): TP-2 stages with the embedding and with the head next to a
# TP-1 stage, under 1F1B and under ZB-H1 (W from the recorded outputs, the norms' outputs DTensors); under ZB-V
# with a tied embedding, recompute on the TP-2 stage and a second pipeline.
SP_CASES = [("tp2-sp.yaml", None), ("tp2-sp.yaml", "zb-h1"), ("zb-v-sp.yaml", None)]


@pytest.mark.parametrize("plan,schedule", SP_CASES,
                         ids=[f"{p.removesuffix('.yaml')}-{s or '1f1b'}" for p, s in SP_CASES])
def test_sequence_parallel_matches_single_device_reference(world: EngineWorld, plan: str, schedule: str | None) -> None:
    path = PLANS / plan
    ctx = load_plan_context(path)
    assert ctx.plan.training.sequence_parallel
    batches = make_batches(ctx)
    results = world.train(str(path), batches, schedule)
    check_against_reference(path, results, batches)


def test_sequence_parallel_with_zero1_matches_single_device_reference(world: EngineWorld) -> None:
    """ZeRO-1 over the two pipelines: the TP-2 stages' norm weights (replicated DTensors under SP) shard
    their moments like any other parameter."""
    path = PLANS / "zb-v-sp.yaml"
    batches = make_batches(load_plan_context(path))
    results = world.train(str(path), batches, zero=True)
    check_against_reference(path, results, batches)


def test_sequence_parallel_shards_the_norms_activations(world: EngineWorld) -> None:
    """Fails if sequence parallelism is silently off: on each TP rank the decoder layers' norms save half
    of what they save without it (1/tp of the tokens), and everything else saves the same (the blocks'
    inputs are gathered whole, as planner/cost.py ``CostModel.layer`` prices it)."""
    path = PLANS / "tp2-sp.yaml"
    out = {r["device"]: r["counts"] for r in world.world.run(saved_activation_job, str(path), timeout_s=120)
           if r is not None}
    assert sorted(out) == [0, 1]
    for dev, counts in out.items():
        off, on = counts["off"], counts["on"]
        assert off["norms"] > 0 and on["norms"] * 2 == off["norms"], (dev, counts)
        assert on["other"] == off["other"], (dev, counts)

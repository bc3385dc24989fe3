"""Fused gradient sync, fused BSR between two plans (with a failed device), the P2P message API for
schedules, and the bottom tier through DTensor, on one 4-process gloo world (device ids != ranks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from oracles import local_view, to_placements

from runtime.comm.execute import pack_message, recv_buffer, run_bsr, start_output, unpack_message
from runtime.comm.world import LocalWorld
from runtime.engine.data_parallel import GradientSync
from runtime.torchfree.annotations import Annotation, DistributedStates
from runtime.torchfree.annotations.from_plan import annotate_strategy, strategy_groups
from runtime.torchfree.comm.bsr import TensorMove, plan_bsr
from runtime.torchfree.comm.gradsync import plan_sync
from runtime.torchfree.comm.resolve import resolve
from runtime.torchfree.spec import Pipeline, Stage, Strategy, load_plan_context

S = DistributedStates
PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
RANK_DEVICES = [2, 0, 3, 1]  # rank r runs device RANK_DEVICES[r]


@pytest.fixture(scope="module")
def world():
    with LocalWorld(4, devices=RANK_DEVICES, timeout_s=60) as w:
        yield w


def tiny():
    ctx = load_plan_context(PLANS / "cpu-hetero4-tiny.yaml")
    return ctx.model, ctx.plan.training, ctx.plan.strategies[0]


def three_device_strategy() -> Strategy:
    """A plan for the survivors when device 3 fails: TP-2 on 0,1 and a single-device pipeline on 2."""
    return Strategy("survivors", (Pipeline(5, (Stage((0, 1), (0, 6)),)), Pipeline(3, (Stage((2,), (0, 6)),))))


def param_values(model, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    from runtime.torchfree.models.params import llama_parameters

    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g).to(dtype) for p in llama_parameters(model)}


def odd_tensor() -> torch.Tensor:
    return torch.arange(15, dtype=torch.float32).view(5, 3).to(torch.bfloat16)


def region(h):
    return tuple(slice(a, b) for a, b in h.region)


# --- gradient sync -----------------------------------------------------------------------------

def _grad_sync_job(ctx, scale: float):
    model, training, strategy = tiny()
    ann = annotate_strategy(strategy, model, training)
    ctx.groups.ensure(strategy_groups(strategy, model, training))
    me = ctx.device
    per_pipe = [param_values(model, 100 + p) for p in range(len(strategy.pipelines))]
    grads = {}
    for p in ann.params:
        lay = p.grad.layout(p.shape)
        if me in lay:
            h = lay.by_device[me]
            pipe = strategy.locate(me)[0]
            grads[p.name] = per_pipe[pipe][p.name][region(h)].clone()
    sync = GradientSync([(p.name, p.shape, p.grad) for p in ann.params],
                        plan_sync([p.grad.layout(p.shape) for p in ann.params], bucket_bytes=16 << 10), ctx.groups)
    sync.sync(grads, scale=scale)
    return {k: v.numpy() for k, v in grads.items()}, len(sync.buckets)


def test_gradient_sync_sums_pipelines_once(world):
    model, training, strategy = tiny()
    scale = 1 / training.global_batch
    results = dict(zip(RANK_DEVICES, world.run(_grad_sync_job, scale)))
    per_pipe = [param_values(model, 100 + p) for p in range(len(strategy.pipelines))]
    ann = annotate_strategy(strategy, model, training)
    checked_dup = False
    for p in ann.params:
        want = (per_pipe[0][p.name] + per_pipe[1][p.name]) * scale
        for dev, h in p.param.layout(p.shape).holdings:
            got = torch.from_numpy(results[dev][0][p.name])
            torch.testing.assert_close(got, want[region(h)], rtol=1e-6, atol=1e-7)
            checked_dup |= h.replica > 0  # a norm weight duplicated in the TP-2 group
    assert checked_dup
    assert all(r[1] > 1 for r in results.values())  # 16 KiB buckets: several collectives per group


# --- fused BSR between two plans, with a failed device -----------------------------------------

def _switch_job(ctx, excluded: tuple[int, ...]):
    model, training, strategy = tiny()
    new = three_device_strategy()
    old_ann, new_ann = annotate_strategy(strategy, model, training), annotate_strategy(new, model, training)
    # An odd-sized bf16 tensor first: the fp32 pieces after it in a message start misaligned.
    odd = TensorMove("odd", (5, 3), torch.bfloat16, Annotation.spmd([0]), Annotation.spmd([1, 2]))
    moves = [odd]
    for p in old_ann.params:
        q = new_ann.param(p.name)
        moves.append(TensorMove(p.name, p.shape, torch.float32, p.param, q.param))
        moves.append(TensorMove(p.name + ":exp_avg", p.shape, torch.bfloat16, p.param, q.param))
    plan = plan_bsr(moves, excluded=excluded)
    me = ctx.device
    if me in excluded:
        return None  # a failed device takes no part
    params, moments = param_values(model, 1), param_values(model, 2, torch.bfloat16)
    local = {}
    for p in old_ann.params:
        lay = p.param.layout(p.shape)
        if me in lay:
            local[p.name] = params[p.name][region(lay.by_device[me])].clone()
            local[p.name + ":exp_avg"] = moments[p.name][region(lay.by_device[me])].clone()
    if me == 0:
        local["odd"] = odd_tensor()
    out = run_bsr(plan, local, ctx.groups)
    senders = sorted({t.src for t in plan.transfers})
    return {k: v.float().numpy() for k, v in out.items()}, senders, len(plan.sends(me))


@pytest.mark.parametrize("excluded", [(), (3,)])
def test_fused_bsr_switch(world, excluded):
    model, training, _ = tiny()
    results = dict(zip(RANK_DEVICES, world.run(_switch_job, excluded)))
    params, moments = param_values(model, 1), param_values(model, 2, torch.bfloat16)
    new_ann = annotate_strategy(three_device_strategy(), model, training)
    for p in new_ann.params:
        for dev, h in p.param.layout(p.shape).holdings:
            got, senders, n_msgs = results[dev]
            assert torch.equal(torch.from_numpy(got[p.name]), params[p.name][region(h)])
            assert torch.equal(torch.from_numpy(got[p.name + ":exp_avg"]), moments[p.name][region(h)].float())
            assert not set(senders) & set(excluded)
            assert n_msgs <= 3  # per-peer packing: at most one message per peer
    for dev in (1, 2):
        assert torch.equal(torch.from_numpy(results[dev][0]["odd"]), odd_tensor().float())
    if excluded:
        assert results[3] is None


# --- P2P messages for a schedule's own batch_isend_irecv ----------------------------------------

def _p2p_api_job(ctx):
    src, dst = Annotation.spmd([0, 1], S.split(1, 2)), Annotation.spmd([2, 3, 1], S.split(1, 3))
    shape = (4, 6)
    op = resolve(src, dst, shape)
    assert op.p2p_only and op.kind == "bsr"
    full = torch.arange(24.0).view(shape)
    me = ctx.device
    x = local_view(op.src, full, me).clone() if me in op.src else None
    out = start_output(op, x, me, dtype=torch.float32, device=torch.device("cpu"))
    ops, inbox = [], []
    for m in op.sends(me):
        ops.append(dist.P2POp(dist.isend, pack_message(op, m, x, me), ctx.groups.ranks[m.peer]))
    for m in op.recvs(me):
        buf = recv_buffer(m, dtype=torch.float32, device=torch.device("cpu"))
        inbox.append((m, buf))
        ops.append(dist.P2POp(dist.irecv, buf, ctx.groups.ranks[m.peer]))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for m, buf in inbox:
        unpack_message(op, m, buf, out, me)
    return None if out is None else out.numpy()


def test_p2p_messages_fuse_into_a_schedule(world):
    results = dict(zip(RANK_DEVICES, world.run(_p2p_api_job)))
    full = torch.arange(24.0).view(4, 6)
    lay = Annotation.spmd([2, 3, 1], S.split(1, 3)).layout((4, 6))
    for dev in (2, 3, 1):
        assert torch.equal(torch.from_numpy(results[dev]), local_view(lay, full, dev))
    assert results[0] is None


# --- bottom tier: our DS <-> DTensor placements ------------------------------------------------

def _dtensor_job(ctx, states: DistributedStates, devices: tuple[int, ...], shape: tuple[int, ...]):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    ann = Annotation.spmd(devices, states)
    lay = ann.layout(shape)
    mesh_shape, placements = to_placements(states)
    ranks = torch.tensor([ctx.groups.ranks[d] for d in devices]).view(mesh_shape)
    mesh = DeviceMesh("cpu", ranks)  # collective on every rank
    full = torch.arange(float(torch.tensor(shape).prod())).view(shape)
    me = ctx.device
    if me not in lay:
        return None
    h = lay.by_device[me]
    local = full[region(h)].clone()
    if states.is_partial:  # summand p of the partial coordinate: the first holds it all
        local = local if h.summand == (0, 0) else torch.zeros_like(local)
    return DTensor.from_local(local, mesh, placements, run_check=False).full_tensor().numpy()


@pytest.mark.parametrize("states", [
    S.split(1, 4),
    S.of({0: 2, 1: 2}, (1, 0)),
    S.of({-2: 2, 0: 2}, (0, -2)),
    S.of({-1: 2, 1: 2}, (-1, 1)),
], ids=str)
def test_bottom_tier_matches_dtensor(world, states):
    # DTensor's collectives follow the group's rank order, so the mesh lists devices in rank order
    # (ProcessGroups.mesh enforces it); our DS enumerates the same devices row-major by ``order``.
    devices = tuple(RANK_DEVICES)
    results = world.run(_dtensor_job, states, devices, (4, 8))
    full = torch.arange(32.0).view(4, 8)
    for r in results:
        assert torch.equal(torch.from_numpy(r), full)


def test_strategy_groups_cover_the_sync(world):
    model, training, strategy = tiny()
    groups = strategy_groups(strategy, model, training)
    assert (0, 1) in groups and (0, 1, 2, 3) in groups
    ann = annotate_strategy(strategy, model, training)
    for p in ann.params:
        assert set(resolve(p.grad, p.param, p.shape).groups()) <= set(groups)
    assert dataclasses.is_dataclass(ann)

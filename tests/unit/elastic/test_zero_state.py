"""What survives a failure under ZeRO-1 with 2 copies of every moment chunk (runtime/torchfree/elastic/state.py
``lost_moments``, ``plan_moment_gather``), for random strategies and failures."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_state import EMU8, strategies_and_failures, with_strategy

from runtime.torchfree.annotations.states import intersect, volume
from runtime.torchfree.elastic.state import check_compatible, lost_moments, moment_slices, plan_moment_gather
from runtime.torchfree.engine.zero import moment_pieces
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext, load_plan_context
from runtime.torchfree.spec.handle import StrategyHandle


def with_copies(h: StrategyHandle, r: int = 2) -> StrategyHandle:
    t = replace(h.ctx.plan.training, zero=True, zero_redundancy=r)
    return StrategyHandle.of(PlanContext(replace(h.ctx.plan, training=t), h.ctx.model, h.ctx.cluster, h.ctx.path),
                             h.name)


def survivors_keep_every_moment(src: StrategyHandle, failed: list[int]) -> bool:
    """Independently of ``lost_moments``: every element of every sharded moment is in some survivor's pieces."""
    slices = moment_slices(src)
    alive = [d for d in src.devices if d not in failed]
    for name, sl in slices.items():
        seen = {s.region: torch.zeros(s.numel, dtype=torch.bool) for s in sl}
        for d in alive:
            for p in moment_pieces(slices, d).get(name, ()):
                seen[p.region][p.start:p.stop] = True
        if not all(bool(v.all()) for v in seen.values()):
            return False
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(strategies_and_failures())
def test_moments_are_lost_exactly_when_no_survivor_keeps_a_chunk_and_else_rebuild_everywhere(case):
    if case is None:
        return
    pipelines, failed, _ = case
    if len(pipelines) < 2:
        return
    src = with_copies(with_strategy(load_plan_context(EMU8), pipelines))
    lost = lost_moments(src, failed)
    assert (not lost) == survivors_keep_every_moment(src, failed)
    if lost:
        assert all(set(t.lost_by) <= set(failed) and len(t.lost_by) == 2 for t in lost)
        with pytest.raises(HspmdError, match="no surviving copy"):
            plan_moment_gather(src, failed)
        return
    plan = plan_moment_gather(src, failed)
    assert not {t.src for t in plan.transfers} & set(failed)
    slices = {f"{s.name}{sfx}@{i}": s for sl in moment_slices(src).values() for i, s in enumerate(sl)
              for sfx in (".exp_avg", ".exp_avg_sq")}
    assert {t.name for t in plan.tensors} == set(slices)
    for i, tensor in enumerate(plan.tensors):
        s = slices[tensor.name]
        assert sorted(tensor.dst.devices) == sorted(d for d in s.devices if d not in failed)
        for dev, held in tensor.dst.holdings:
            assert held.region == ((0, s.numel),)  # the whole slice on every surviving replica
            parts = [c.region for c in plan.local_copies(dev) if c.tensor == i]
            parts += [t.region for t in plan.transfers if t.dst == dev and t.tensor == i]
            assert sum(volume(p) for p in parts) == s.numel
            assert all(intersect(a, b) is None for k, a in enumerate(parts) for b in parts[k + 1:])
        for t in (t for t in plan.transfers if t.tensor == i):
            a, b = s.chunk(t.src)
            assert a <= t.region[0][0] and t.region[0][1] <= b  # a sender sends only its own chunk


def test_switches_take_two_copies_and_refuse_one() -> None:
    ctx = load_plan_context(EMU8)
    src = with_strategy(ctx, [(1, [((0,), (0, 6))]), (1, [((1,), (0, 6))])])
    check_compatible(with_copies(src).ctx, src.ctx)
    with pytest.raises(HspmdError, match="zero_redundancy: 2"):
        check_compatible(with_copies(src, 1).ctx, src.ctx)


@pytest.mark.parametrize("dead", [0, 1, 2, 3])
def test_after_an_interrupted_all_gather_the_parameters_are_rebuilt_from_the_chunk_holders(dead: int) -> None:
    src = with_copies(with_strategy(load_plan_context(EMU8), [(1, [((d,), (0, 6))]) for d in range(4)]))
    moments = plan_moment_gather(src, [dead])
    both = plan_moment_gather(src, [dead], ungathered=True)
    slices = {f"{s.name}@{i}": s for sl in moment_slices(src).values() for i, s in enumerate(sl)}
    params = {i: t for i, t in enumerate(both.tensors) if t.name in slices}
    # Each slice's parameters ride with its moments: the same size, to every surviving replica, whole.
    assert len(params) == len(slices) and len(both.tensors) == 3 * len(slices)
    assert both.total_bytes == pytest.approx(1.5 * moments.total_bytes)
    for i, tensor in params.items():
        s = slices[tensor.name]
        assert sorted(tensor.dst.devices) == sorted(d for d in s.devices if d != dead)
        for t in (t for t in both.transfers if t.tensor == i):
            a, b = s.chunk(t.src)
            assert t.src != dead and a <= t.region[0][0] and t.region[0][1] <= b  # only a holder's own chunk

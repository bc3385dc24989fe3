"""The BSR planner: LCM slices, sender choice, exclusions, fusion, cost model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.torchfree.annotations import Annotation, DistributedStates
from runtime.torchfree.comm.bsr import TensorMove, plan_bsr
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_cluster

S = DistributedStates
spmd = Annotation.spmd


def dup_everywhere(devs):
    return spmd(devs)


def test_prefers_bandwidth_then_load():
    # Devices 0 and 1 both hold everything; 1 is on the receiver's node.
    bw = lambda a, b: 100.0 if {a, b} <= {1, 2, 3} else 10.0
    moves = [TensorMove("w", (8,), torch.float32, dup_everywhere([0, 1]), spmd([2, 3], S.split(0, 2)))]
    plan = plan_bsr(moves, bandwidth=bw)
    assert {t.src for t in plan.transfers} == {1}
    # Uniform bandwidth: the two owners share the work.
    plan = plan_bsr(moves)
    assert sorted(t.src for t in plan.transfers) == [0, 1]


def test_excluded_never_send_and_lost_slices_are_named():
    src = Annotation.union(-1, [((0, 1), S.split(0, 2)), ((2,), S.of())])
    moves = [TensorMove("layers.3.w", (4, 2), torch.float32, src, spmd([3, 4], S.split(0, 2)))]
    plan = plan_bsr(moves, excluded={2})
    assert {t.src for t in plan.transfers} <= {0, 1}
    plan = plan_bsr(moves, excluded={0, 1})
    assert {t.src for t in plan.transfers} == {2}
    lost = [TensorMove("layers.3.w", (4, 2), torch.float32, spmd([0, 1], S.split(0, 2)), spmd([3]))]
    with pytest.raises(HspmdError, match=r"tensor layers\.3\.w: slice \[0:2, 0:2\] .* excluded device\(s\) \[0\]"):
        plan_bsr(lost, excluded={0})
    with pytest.raises(HspmdError, match="uses excluded device"):
        plan_bsr(moves, excluded={3})


def test_partial_source_is_rejected():
    moves = [TensorMove("g", (4,), torch.float32, spmd([0, 1], S.partial(2)), spmd([2]))]
    with pytest.raises(HspmdError, match="reduced before a BSR"):
        plan_bsr(moves)


def test_fused_messages_one_per_peer_and_bytes():
    src, dst = spmd([0, 1], S.split(0, 2)), spmd([2, 3], S.split(0, 2))
    moves = [TensorMove(f"t{i}", (4, 3), dt, src, dst) for i, dt in enumerate([torch.float32, torch.bfloat16])]
    plan = plan_bsr(moves)
    sends = plan.sends(0)
    assert len(sends) == 1 and sends[0].peer == 2
    assert sends[0].nbytes == 2 * 3 * 4 + 2 * 3 * 2
    assert [p.tensor for p in sends[0].pieces] == [0, 1]


def test_cost_model_by_hand():
    # 0 sends 8 floats to 1 over 1 GB/s, and to 2 over 2 GB/s: egress 32/1e9 + 32/2e9.
    bw = lambda a, b: 1.0 if {a, b} == {0, 1} else 2.0
    moves = [TensorMove("x", (8,), torch.float32, spmd([0]), spmd([1, 2]))]
    plan = plan_bsr(moves, bandwidth=bw)
    assert plan.device_times(bw)[0] == pytest.approx((32 / 1e9 + 32 / 2e9, 0.0))
    assert plan.modelled_time(bw) == pytest.approx(48 / 1e9)
    # Only 0 holds it: the sole owner's forced sends bound the time.
    assert plan.lower_bound(bw) == pytest.approx(48 / 1e9)


def test_naive_is_first_owner():
    src = Annotation.union(-1, [((0,), S.of()), ((1,), S.of()), ((2,), S.of())])
    moves = [TensorMove("x", (12,), torch.float32, src, spmd([3, 4, 5], S.split(0, 3)))]
    assert {t.src for t in plan_bsr(moves, policy="first_owner").transfers} == {0}
    assert {t.src for t in plan_bsr(moves).transfers} == {0, 1, 2}


def test_fused_balances_across_tensors():
    # Many small tensors, each with two owners: planned one by one every tensor picks the first
    # owner; fused, the load alternates.
    src = Annotation.union(-1, [((0,), S.of()), ((1,), S.of())])
    moves = [TensorMove(f"t{i}", (4,), torch.float32, src, spmd([2])) for i in range(10)]
    fused = plan_bsr(moves)
    single = sum(plan_bsr([m]).modelled_time() for m in moves)
    assert fused.modelled_time() == pytest.approx(fused.lower_bound())
    assert single > fused.modelled_time()


def test_paper_cluster_bandwidths_are_used():
    cluster = load_cluster("h800-h20-48")
    src = Annotation.union(-1, [((0,), S.of()), ((16,), S.of())])
    moves = [TensorMove("x", (64,), torch.bfloat16, src, spmd([17]))]
    plan = plan_bsr(moves, bandwidth=cluster)
    assert {t.src for t in plan.transfers} == {16}  # same H20 node (450 GB/s) over the H800 (50 GB/s)


@st.composite
def moves_case(draw):
    sizes = draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=3))
    devs = draw(st.permutations(list(range(8))))
    src_members = []
    for k in sizes:
        if k > len(devs):
            break
        src_members.append((tuple(devs[:k]), S.split(0, k) if k > 1 else S.of()))
        devs = devs[k:]
    used = [d for m, _ in src_members for d in m]
    src = Annotation.union(-1, src_members)
    k = draw(st.sampled_from([1, 2, 3, 4]))
    dst_devs = draw(st.permutations(list(range(12))))[:k]
    dst = spmd(dst_devs, S.split(0, k) if k > 1 else S.of())
    excl = draw(st.sets(st.sampled_from(used), max_size=2)) - set(dst_devs)
    return TensorMove("w", (24, 2), torch.float32, src, dst), excl


@settings(max_examples=60, deadline=None)
@given(moves_case())
def test_plan_covers_every_need_exactly_once(case):
    move, excl = case
    try:
        plan = plan_bsr([move], excluded=excl)
    except HspmdError as err:
        assert "no surviving owner" in str(err)
        return
    src, dst = move.src.layout(move.shape), move.dst.layout(move.shape)
    cover = {d: torch.zeros(dst.local_shape(d), dtype=torch.int64) for d in dst.devices}
    for c in plan.local:
        r = dst.region(c.device)
        cover[c.device][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(c.region, r))] += 1
    for t in plan.transfers:
        assert t.src not in excl
        assert all(a >= sa and b <= sb for (a, b), (sa, sb) in zip(t.region, src.region(t.src)))
        r = dst.region(t.dst)
        cover[t.dst][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(t.region, r))] += 1
    assert all(bool((c == 1).all()) for c in cover.values())
    assert plan.modelled_time() >= plan.lower_bound() - 1e-18

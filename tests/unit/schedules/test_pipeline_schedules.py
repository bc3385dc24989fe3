"""Pipeline schedules (runtime/torchfree/pipeline_schedules.py): every schedule from the one list scheduler,
played on the simulated machine of ``check_schedule`` (blocking waits, one FIFO stream per device
pair, in-order matching without tags), for random shapes and random uneven per-chunk costs."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.torchfree.pipeline_schedules import (
    ChunkCost,
    Compute,
    Costs,
    Message,
    PostRecv,
    PostSend,
    Schedule,
    WaitRecv,
    WaitSends,
    build_schedule,
    check_schedule,
    step_time,
)
from runtime.torchfree.schedule_policies import (
    SCHEDULE_NAMES,
    Layout,
    chunk_problems,
    device_limits,
    limit_problems,
    live_activation_limit,
    schedule_layout,
    schedule_problems,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(s: Schedule):
    return check_schedule(s.actions, s.layout, s.micro_batches, split_backward=s.split_backward)


def crossings(layout: Layout) -> int:
    """Virtual-stage boundaries whose two sides sit on different devices."""
    return sum(layout.device(j) != layout.device(j + 1) for j in range(layout.num_stages - 1))


@st.composite
def shapes(draw):
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    s = draw(st.integers(1, 8))
    m = draw(st.integers(s if name == "interleaved" else 1, 16))
    v = draw(st.integers(1, 4)) if name == "interleaved" else None
    layout = schedule_layout(name, s, v)
    cost = st.floats(0.1, 4.0, allow_nan=False)
    costs = Costs(tuple(tuple(ChunkCost(draw(cost), draw(cost), draw(cost)) for _ in range(layout.chunks))
                        for _ in range(s)),
                  tuple(draw(st.floats(0.0, 1.0)) for _ in range(layout.num_stages - 1)))
    return name, s, m, v, costs


# -- the action lists are correct for every shape and every cost ------------------------------------


@SETTINGS
@given(shapes())
def test_every_schedule_plays_out_on_uneven_costs(shape) -> None:
    name, s, m, v, costs = shape
    sched = build_schedule(name, s, m, v, costs)
    report = check(sched)
    assert report.problems == () and report.ok and not report.deadlock
    assert report.transfers == 2 * m * crossings(sched.layout)  # an activation and a gradient each
    for d in range(s):
        assert report.peak_live[d] <= live_activation_limit(name, s, d, m, v)
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "BW")
    ops = [t.op for d in range(s) for t in sched.timeline[d]]
    assert sorted((o.kind, o.micro_batch, o.stage) for o in ops) == sorted(
        itertools.product(kinds, range(m), range(sched.layout.num_stages)))


@SETTINGS
@given(shapes(), st.data())
def test_raised_activation_limits_play_out_and_bound_the_peak(shape, data) -> None:
    """A plan may raise a stage's activation bound (``activation_limits``): the lists still play out
    without deadlock, every op once, and each device's peak stays within its raised bound."""
    name, s, m, v, costs = shape
    own = device_limits(name, s, m, v)
    limits = [x + data.draw(st.integers(0, 2 * s)) for x in own]
    sched = build_schedule(name, s, m, v, costs, limits)
    report = check(sched)
    assert report.ok and not report.deadlock
    assert report.transfers == 2 * m * crossings(sched.layout)
    bounds = device_limits(name, s, m, v, limits)
    assert sched.activation_limits() == bounds
    assert all(own[d] <= bounds[d] <= sched.layout.chunks * m for d in range(s))
    assert all(report.peak_live[d] <= bounds[d] for d in range(s))
    kinds = ("F", "B", "W") if sched.split_backward else ("F", "BW")
    ops = [t.op for d in range(s) for t in sched.timeline[d]]
    assert sorted((o.kind, o.micro_batch, o.stage) for o in ops) == sorted(
        itertools.product(kinds, range(m), range(sched.layout.num_stages)))
    assert step_time(name, s, m, v, costs, limits) == sched.makespan


def test_raised_limits_let_zb_h1_defer_w_into_the_fill() -> None:
    """4 equal stages, F = B = W = 1, 8 micro-batches: ZB-H1 under its own bound takes
    m * 3 + (S - 1) * 2 = 30 (the documented closed form). With each stage allowed S - 1 = 3 more
    activations the stages defer W's into their fill and drain: 27, which no order can beat (the last
    stage cannot start before 3 forwards reached it, and then has 8 * 3 of work)."""
    costs = Costs.uniform(Layout(4), ChunkCost(1.0, 1.0, 1.0))
    assert step_time("zb-h1", 4, 8, None, costs) == pytest.approx(30.0)
    assert step_time("zb-h1", 4, 8, None, costs, [7, 6, 5, 4]) == pytest.approx(27.0)
    # Limits below the schedule's own bound are raised to it: the same lists as none.
    low = build_schedule("zb-h1", 4, 8, None, costs, [1, 1, 1, 1])
    assert low.activation_limits() == (4, 3, 2, 1)
    assert low.actions == build_schedule("zb-h1", 4, 8, None, costs).actions


def test_limit_problems() -> None:
    assert limit_problems("1f1b", 3, 8, None, [3, 2, 1]) == []
    assert limit_problems("1f1b", 3, 8, None, [3, 2]) == ["activation_limits: lists 2 limit(s) for 3 stage(s)"]
    assert limit_problems("zb-h1", 3, 8, None, [3, 1, 1]) == [
        "activation_limits[1]: 1 is below zb-h1's own bound of 2 activations for this stage"]
    assert limit_problems("1f1b", 2, 4, None, [2.5, 1]) == ["activation_limits: limits must be integers, got [2.5]"]
    with pytest.raises(ValueError, match="activation_limits: lists 1 limit"):
        build_schedule("1f1b", 2, 4, None, None, [3])


@SETTINGS
@given(shapes())
def test_timeline_respects_dependencies_and_transfer_times(shape) -> None:
    name, s, m, v, costs = shape
    sched = build_schedule(name, s, m, v, costs)
    lay = sched.layout
    end = {(t.op.kind, t.op.micro_batch, t.op.stage): t.end for d in range(s) for t in sched.timeline[d]}
    bk = "B" if sched.split_backward else "BW"
    for d in range(s):
        prev_end = 0.0
        for t in sched.timeline[d]:
            o = t.op
            assert lay.device(o.stage) == d and lay.chunk(o.stage) == o.chunk
            assert t.start >= prev_end  # one op at a time per device
            assert t.end - t.start == pytest.approx(costs.chunk(d, o.chunk).of(o.kind))
            prev_end = t.end
            deps = []
            if o.kind == "F" and o.stage > 0:
                deps.append(("F", o.stage - 1))
            if o.kind in ("B", "BW"):
                deps.append(("F", o.stage))
                if o.stage < lay.num_stages - 1:
                    deps.append((bk, o.stage + 1))
            if o.kind == "W":
                deps.append(("B", o.stage))
            for kind, j in deps:
                hop = costs.transfer(min(j, o.stage)) if lay.device(j) != d else 0.0
                assert t.start >= end[(kind, o.micro_batch, j)] + hop - 1e-9


@SETTINGS
@given(shapes())
def test_each_pair_posts_its_messages_in_one_order_on_both_sides(shape) -> None:
    name, s, m, v, costs = shape
    sched = build_schedule(name, s, m, v, costs)
    for a, b in itertools.combinations(range(s), 2):
        def pair(d: int, peer: int):
            return [x.message for x in sched.actions[d] if isinstance(x, (PostSend, PostRecv))
                    and {x.message.src, x.message.dst} == {d, peer}]
        assert pair(a, b) == pair(b, a)
    for d in range(s):
        acts = sched.actions[d]
        assert isinstance(acts[-1], WaitSends)
        for i, x in enumerate(acts):
            if isinstance(x, PostRecv):  # posted as early as the pair's order allows
                peer = x.message.src
                before = [k for k in range(i) if isinstance(acts[k], (PostSend, PostRecv))
                          and peer in (acts[k].message.src, acts[k].message.dst)]
                assert all(isinstance(a, PostRecv) for a in acts[(before[-1] + 1 if before else 0):i])
        for i, x in enumerate(acts):
            if isinstance(x, WaitRecv):  # right before the op that reads it
                nxt = acts[i + 1]
                assert isinstance(nxt, Compute) and nxt.micro_batch == x.message.micro_batch
                assert nxt.stage == x.message.dst_stage


# -- the checker catches broken lists (so a passing check means something) ---------------------------


@SETTINGS
@given(shapes(), st.data())
def test_swapping_two_posts_of_a_pair_is_caught(shape, data) -> None:
    name, s, m, v, costs = shape
    sched = build_schedule(name, s, m, v, costs)
    candidates = []
    for d in range(s):
        for peer in range(s):
            idx = [i for i, x in enumerate(sched.actions[d]) if isinstance(x, (PostSend, PostRecv))
                   and peer in (x.message.src, x.message.dst) and peer != d]
            candidates += [(d, i, k) for i, k in zip(idx, idx[1:])]
    if not candidates:
        return  # one device, or nothing crosses devices
    d, i, k = data.draw(st.sampled_from(candidates))
    acts = [list(x) for x in sched.actions]
    acts[d][i], acts[d][k] = acts[d][k], acts[d][i]
    report = check_schedule(acts, sched.layout, m, split_backward=sched.split_backward)
    assert not report.ok


def test_checker_reports_missing_wait_duplicate_and_missing_ops() -> None:
    sched = build_schedule("1f1b", 3, 4)
    acts = [list(x) for x in sched.actions]
    wait = next(i for i, x in enumerate(acts[1]) if isinstance(x, WaitRecv))
    del acts[1][wait]
    assert any("before waiting" in p for p in check_schedule(acts, sched.layout, 4, split_backward=False).problems)

    acts = [list(x) for x in sched.actions]
    first = next(x for x in acts[2] if isinstance(x, Compute))
    acts[2].insert(acts[2].index(first), first)
    assert any("runs twice" in p for p in check_schedule(acts, sched.layout, 4, split_backward=False).problems)

    acts = [list(x) for x in sched.actions]
    last_bw = max(i for i, x in enumerate(acts[0]) if isinstance(x, Compute))
    del acts[0][last_bw]
    assert any("never runs" in p for p in check_schedule(acts, sched.layout, 4, split_backward=False).problems)


def test_checker_reports_a_deadlock() -> None:
    # Device 0 waits for the gradient before sending the activation device 1 waits for.
    lay = Layout(2)
    sched = build_schedule("1f1b", 2, 1)
    a0 = list(sched.actions[0])
    send = next(x for x in a0 if isinstance(x, PostSend))
    a0.remove(send)
    a0.insert(a0.index(next(x for x in a0 if isinstance(x, WaitRecv))) + 1, send)
    report = check_schedule([a0, list(sched.actions[1])], lay, 1, split_backward=False)
    assert report.deadlock and any(p.startswith("deadlock") for p in report.problems)


def test_checker_reports_mismatched_contents_under_in_order_matching() -> None:
    # Two activations to the same peer, received in the other order: without tags, the first receive
    # gets the first send, so each receive gets the wrong micro-batch.
    sched = build_schedule("gpipe", 2, 2)
    a1 = list(sched.actions[1])
    recvs = [i for i, x in enumerate(a1) if isinstance(x, PostRecv) and x.message.kind == "activation"]
    a1[recvs[0]], a1[recvs[1]] = a1[recvs[1]], a1[recvs[0]]
    report = check_schedule([list(sched.actions[0]), a1], sched.layout, 2, split_backward=False)
    assert any("matches the send of" in p for p in report.problems)


# -- 1F1B and GPipe are the classic orders ---------------------------------------------------------------


def classic_order(name: str, s: int, d: int, m: int) -> list[tuple[str, int]]:
    """The textbook orders, written out as the test's oracle: GPipe all forwards then all backwards; 1F1B
    min(S - d - 1, m) warm-up forwards, then one forward and one backward alternating, then the drain."""
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("BW", i) for i in range(m)]
    warmup = min(s - d - 1, m)
    out = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [("F", warmup + i), ("BW", i)]
    return out + [("BW", i) for i in range(m - warmup, m)]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_orders_equal_the_classic_schedules(name: str) -> None:
    for s in range(1, 9):
        for m in range(1, 17):
            sched = build_schedule(name, s, m)
            for d in range(s):
                assert [(o.kind, o.micro_batch) for o in sched.order(d)] == classic_order(name, s, d, m)


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for s in range(1, 9):
        for m in range(s, 17):
            a, b = build_schedule("interleaved", s, m, 1), build_schedule("1f1b", s, m)
            assert [a.order(d) for d in range(s)] == [b.order(d) for d in range(s)]


# -- memory and step time as documented -----------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_peak_reaches_the_documented_bound_with_unit_costs(name: str) -> None:
    # F = B = W (any scale gives the same order). A last, partial group of interleaved
    # micro-batches (m not a multiple of S) stays below the bound, as documented.
    for s in range(1, 9):
        for m in sorted({1, s, min(2 * s, 16), 16}):
            for v in ((1, 2, 3, 4) if name == "interleaved" else (None,)):
                if name == "interleaved" and m % s:
                    continue
                sched = build_schedule(name, s, m, v)
                assert check(sched).peak_live == tuple(live_activation_limit(name, s, d, m, v) for d in range(s))


def test_documented_bounds() -> None:
    assert [live_activation_limit("1f1b", 4, d, 8) for d in range(4)] == [4, 3, 2, 1]
    assert [live_activation_limit("1f1b", 4, d, 2) for d in range(4)] == [2, 2, 2, 1]
    assert [live_activation_limit("zb-h1", 4, d, 8) for d in range(4)] == [4, 3, 2, 1]
    assert [live_activation_limit("gpipe", 4, d, 8) for d in range(4)] == [8] * 4
    # Megatron's warm-up 2(S-s-1) + (v-1)S, plus the one forward of the first steady step
    assert [live_activation_limit("interleaved", 4, d, 8, 2) for d in range(4)] == [11, 9, 7, 5]
    assert [live_activation_limit("zb-v", 4, d, 8) for d in range(4)] == [8] * 4
    assert [live_activation_limit("zb-v", 4, d, 3) for d in range(4)] == [6] * 4


equal = st.floats(0.1, 4.0, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), equal, equal, equal)
def test_step_time_closed_forms_on_equal_stages(s: int, m: int, f: float, b: float, w: float) -> None:
    cost = ChunkCost(f, b, w)
    bw = b + w
    for name in ("1f1b", "gpipe"):
        assert step_time(name, s, m, costs=Costs.uniform(Layout(s), cost)) == pytest.approx((m + s - 1) * (f + bw))
    zb = step_time("zb-h1", s, m, costs=Costs.uniform(Layout(s), cost))
    assert zb == pytest.approx(m * (f + b + w) + (s - 1) * (f + b))
    if s > 1:
        assert zb < (m + s - 1) * (f + bw)  # W fills the bubble: (S-1) W shorter than 1F1B


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(2, 4), equal)
def test_interleaved_closed_form_and_bubble(s: int, groups: int, v: int, unit: float) -> None:
    m = s * groups
    if m > 16:
        return
    per_chunk = ChunkCost(unit, unit, unit)  # F = B = W; BW = 2F
    t = step_time("interleaved", s, m, v, Costs.uniform(Layout(s, v), per_chunk))
    assert t == pytest.approx((v * m + s - 1) * 3 * unit)
    # the same model on 1F1B: each stage is v chunks long
    one = step_time("1f1b", s, m, costs=Costs.uniform(Layout(s), ChunkCost(v * unit, v * unit, v * unit)))
    assert one == pytest.approx((m + s - 1) * 3 * v * unit)
    if s > 1:
        assert t < one


def test_zero_bubble_v_beats_h1_beats_1f1b_on_equal_stages() -> None:
    for s in range(2, 9):
        for m in (1, 2, 3, 5, 8, 13, 16):
            stage = ChunkCost(2.0, 2.0, 2.0)  # a full stage; ZB-V's chunks are half of it
            one = step_time("1f1b", s, m, costs=Costs.uniform(Layout(s), stage))
            h1 = step_time("zb-h1", s, m, costs=Costs.uniform(Layout(s), stage))
            v = step_time("zb-v", s, m)  # unit costs per half-stage chunk
            assert v < h1 < one


def test_step_time_grows_with_transfer_time() -> None:
    lay = Layout(4)
    base = step_time("1f1b", 4, 8)
    slow = step_time("1f1b", 4, 8, costs=Costs.uniform(lay, transfer=0.5))
    assert slow > base
    # Stage 1 twice as slow (F = 2, BW = 4): it starts at t = 1, is busy 8 * 6 = 48, idles 2 waiting
    # for the first gradient (F0 ends at 3 on stage 1; stages 2, 3 return it at 9 while stage 1's two
    # warm-up forwards end at 7), and stage 0's last backward takes 2 after it: 1 + 48 + 2 + 2. The
    # 1F1B closed form (m - 1) * max + sum = 57 is an upper bound here.
    costs = Costs(((ChunkCost(),), (ChunkCost(2, 2, 2),), (ChunkCost(),), (ChunkCost(),)))
    assert step_time("1f1b", 4, 8, costs=costs) == pytest.approx(53)


# -- layouts, validation --------------------------------------------------------------------------------


def test_v_placement() -> None:
    lay = Layout(4, 2, "v")
    assert [lay.device(j) for j in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [lay.chunk(j) for j in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    loop = Layout(3, 2)
    assert [loop.device(j) for j in range(6)] == [0, 1, 2, 0, 1, 2]
    for lay in (Layout(4, 2, "v"), Layout(3, 4), Layout(1, 3)):
        assert all(lay.stage(lay.device(j), lay.chunk(j)) == j for j in range(lay.num_stages))
    with pytest.raises(ValueError, match="chunks"):
        Layout(4, 3, "v")


def test_schedule_problems() -> None:
    assert schedule_problems("1f1b", 4, 2) == []
    assert schedule_problems("interleaved", 4, 4, 2) == []
    assert schedule_problems("zb-v", 3, 1) == []
    [p] = schedule_problems("zb-h2", 4, 8)
    assert p.startswith("schedule: unknown schedule 'zb-h2'") and "interleaved" in p
    [p] = schedule_problems("interleaved", 4, 3, 2)
    assert p.startswith("micro_batches: interleaved needs at least one micro-batch per stage (4), got 3")
    assert schedule_problems("zb-v", 4, 8, 3) == ["chunks: zb-v holds 2 chunk(s) per device, got 3"]
    assert schedule_problems("1f1b", 4, 8, 2) == ["chunks: 1f1b holds 1 chunk(s) per device, got 2"]
    assert schedule_problems("gpipe", 2, 0) == ["micro_batches: need at least one micro-batch, got 0"]
    with pytest.raises(ValueError, match="^micro_batches: interleaved needs"):
        build_schedule("interleaved", 4, 2, 2)
    with pytest.raises(ValueError, match="^schedule: unknown schedule"):
        build_schedule("dualpipe", 4, 8)


def test_cost_problems() -> None:
    with pytest.raises(ValueError, match="^forward: op durations must be positive"):
        ChunkCost(forward=0.0)
    with pytest.raises(ValueError, match=r"^boundary\[1\]"):
        Costs(boundary=(0.0, -1.0))
    with pytest.raises(ValueError, match=r"costs.chunks\[0\]: 1 chunks, the schedule has 2"):
        build_schedule("zb-v", 2, 4, costs=Costs(((ChunkCost(),), (ChunkCost(),))))
    with pytest.raises(ValueError, match="costs.boundary: 1 boundaries"):
        build_schedule("1f1b", 3, 4, costs=Costs(boundary=(0.1,)))


def test_chunk_problems() -> None:
    # 2 devices x 2 chunks, loop placement: virtual stages 0..3 = d0c0, d1c0, d0c1, d1c1
    assert chunk_problems([[(0, 3), (5, 8)], [(3, 5), (8, 10)]], 10) == []
    # V placement: d0c0, d1c0, d1c1, d0c1
    assert chunk_problems([[(0, 3), (8, 10)], [(3, 5), (5, 8)]], 10, "v") == []
    assert chunk_problems([[(0, 4)], [(4, 8)]], 8) == []
    [p] = chunk_problems([[(0, 5)], [(4, 8)]], 8)
    assert p == "stages[1].layers: overlaps layers [4, 5) of stage 0"
    [p] = chunk_problems([[(0, 3)], [(4, 8)]], 8)
    assert p == "stages[1].layers: leaves layers [3, 4) uncovered (stage 0 ends at 3)"
    [p] = chunk_problems([[(1, 3)], [(3, 8)]], 8)
    assert p == "stages[0].layers: leaves layers [0, 1) uncovered (the first stage must start at 0)"
    [p] = chunk_problems([[(0, 3)], [(3, 6)]], 8, model="llama-x")
    assert p == "stages[1].layers: pipeline ends at layer 6, leaving layers [6, 8) of llama-x uncovered"
    [p] = chunk_problems([[(0, 3)], [(3, 9)]], 8)
    assert p == "stages[1].layers: range [3, 9) goes past the model's 8 layers"
    [p] = chunk_problems([[(0, 3)], [(3, 3)]], 3)
    assert p.startswith("stages[1].layers: must be a non-empty range")
    # Chunks in the wrong virtual-stage order: the gap and the overlap it causes, named by chunk.
    got = chunk_problems([[(0, 3), (3, 5)], [(5, 8), (8, 10)]], 10)
    assert got == ["stages[1].layers[0]: leaves layers [3, 5) uncovered "
                   "(virtual stage 0 (stages[0].layers[0], loop placement) ends at 3)",
                   "stages[0].layers[1]: overlaps layers [3, 5) of the virtual stages before it"]
    [p] = chunk_problems([[(0, 3), (4, 8)], [(3, 5), (8, 10)]], 10)
    assert p == ("stages[0].layers[1]: overlaps layers [4, 5) of virtual stage 1 "
                 "(stages[1].layers[0], loop placement)")
    [p] = chunk_problems([[(0, 3), (5, 8)], [(3, 5)]], 8)
    assert p.startswith("stages: every stage needs the same number of chunks")
    [p] = chunk_problems([[(0, 3), (5, 8), (8, 9)], [(3, 5), (9, 10), (10, 11)]], 11, "v")
    assert p.startswith("stages: chunks: the V placement has exactly 2 chunks per device, got 3")


@given(st.integers(1, 6), st.integers(1, 3), st.data())
def test_chunk_problems_accepts_every_tiling(devices: int, chunks: int, data) -> None:
    """Any cut of the layers into S*v non-empty ranges, placed in virtual-stage order, is accepted;
    shifting one boundary by a layer is rejected."""
    n = devices * chunks
    cuts = sorted(data.draw(st.sets(st.integers(1, 3 * n), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, (cuts[-1] if cuts else 0) + data.draw(st.integers(1, 3))]
    layout = Layout(devices, chunks)
    ranges = [[(0, 0)] * chunks for _ in range(devices)]
    for j in range(n):
        ranges[layout.device(j)][layout.chunk(j)] = (bounds[j], bounds[j + 1])
    assert chunk_problems(ranges, bounds[-1]) == []
    if n > 1:
        j = data.draw(st.integers(1, n - 1))
        d, c = layout.device(j), layout.chunk(j)
        a, b = ranges[d][c]
        ranges[d][c] = (a + 1, b) if b - a > 1 else (a - 1, b)
        assert chunk_problems(ranges, bounds[-1]) != []


def test_peak_activation_memory_weighs_uneven_chunks() -> None:
    sched = build_schedule("interleaved", 2, 4, 2)
    counts = check(sched).peak_live
    assert sched.peak_activation_memory([[1.0, 1.0], [1.0, 1.0]]) == tuple(float(c) for c in counts)
    assert sched.activation_limits() == counts  # equal stages, m a multiple of S: the bound is reached
    # Device 0's chunk 1 three times larger: its peak is at least the bound's worth of chunk-0
    # activations and at most the bound's worth of chunk-1 ones, and grows with the chunk's size.
    heavy = sched.peak_activation_memory([[1.0, 3.0], [1.0, 1.0]])
    assert counts[0] < heavy[0] <= 3 * counts[0] and heavy[1] == counts[1]


def test_actions_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="^kind: unknown op"):
        Compute("X", 0, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^src_stage, dst_stage"):
        Message("gradient", 0, 1, 2, 1, 0)
    with pytest.raises(ValueError, match="^src, dst"):
        Message("activation", 0, 3, 4, 3, 3)

"""runtime/torchfree/elastic/preplan.py: the losses planned ahead for a layout, the cache keyed by its survivor set and
replaced with the layout, and a stop that lets no further replan start."""

from __future__ import annotations

import threading
import time

from test_state import EMU8, with_strategy

from runtime.torchfree.elastic.preplan import Preplanner, candidates, grown, returns, survivors
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import load_plan_context


def layouts():
    ctx = load_plan_context(EMU8)
    four = with_strategy(ctx, [(1, [((d,), (0, 6))]) for d in range(4)], "four")
    three = with_strategy(ctx, [(1, [((d,), (0, 6))]) for d in (0, 2, 3)], "three")
    return ctx, four, three


def wait_for(cond, timeout_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "the background work did not finish"
        time.sleep(0.01)


def test_every_device_then_every_node_with_two_of_the_layouts_devices():
    _, four, _ = layouts()
    nodes: dict[str, set[int]] = {}
    for d in four.cluster.devices:
        nodes.setdefault(d.node, set()).add(d.id)
    want = [frozenset({d}) for d in range(4)] + [frozenset(devs) for _, devs in sorted(nodes.items())
                                                  if len(devs & {0, 1, 2, 3}) > 1]
    assert candidates(four, set(range(four.cluster.num_devices))) == want
    assert survivors(four, {1, 7}) == (0, 2, 3)


def test_plans_are_found_by_survivor_set_and_only_for_their_layout():
    _, four, three = layouts()
    asked = []

    def replan(failed, c, strategy, steps_left):
        asked.append((failed, strategy, steps_left))
        if {0, 1, 2, 3} <= failed:
            raise HspmdError("nothing left")
        return c

    p = Preplanner(replan)
    p.begin(four, [frozenset({1}), frozenset({2, 3}), frozenset({0, 1, 2, 3}), frozenset({6})], frozenset({7}), 9)
    wait_for(lambda: len(asked) == 3 and p.notes())
    # device 6 is not in the layout: nothing to plan; device 7 was lost before and is passed on
    assert asked == [(frozenset({1, 7}), "four", 9), (frozenset({2, 3, 7}), "four", 9),
                     (frozenset({0, 1, 2, 3, 7}), "four", 9)]
    assert p.lookup(four, {1}).context is four.ctx and p.lookup(four, {1, 7}).context is four.ctx  # same survivors
    assert p.lookup(four, {3, 2}) is not None
    assert p.lookup(four, {0}) is None and p.lookup(four, {0, 1, 2, 3}) is None  # not planned / no plan
    assert p.lookup(three, {2}) is None  # another layout
    p.begin(three, [frozenset({2})], frozenset({1}), 5)
    wait_for(lambda: p.lookup(three, {1, 2}) is not None)
    assert p.lookup(four, {1}) is None  # replaced with the layout


def test_a_stop_lets_no_further_replan_start_and_keeps_what_was_planned():
    _, four, _ = layouts()
    release = threading.Event()
    asked = []

    def replan(failed, c, strategy, steps_left):
        asked.append(failed)
        if len(asked) == 2:
            release.wait(10.0)  # in flight while the stop comes
        return c

    p = Preplanner(replan)
    p.begin(four, [frozenset({d}) for d in range(4)], frozenset(), 3)
    wait_for(lambda: len(asked) == 2)
    p.stop()
    release.set()
    time.sleep(0.2)
    assert asked == [frozenset({0}), frozenset({1})]  # the third never started
    assert p.lookup(four, {0}) is not None  # made before the stop: kept
    assert p.lookup(four, {1}) is None  # in flight at the stop: dropped


def test_returns_are_the_devices_out_of_the_layout_then_their_nodes():
    _, four, three = layouts()
    nodes: dict[str, set[int]] = {}
    for d in three.cluster.devices:
        nodes.setdefault(d.node, set()).add(d.id)
    out = {1, 5, 6, 7, 2}  # 2 is in the layout: not a return
    want = [frozenset({d}) for d in (1, 5, 6, 7)] + [frozenset(devs & {1, 5, 6, 7}) for _, devs in
                                                     sorted(nodes.items()) if len(devs & {1, 5, 6, 7}) > 1]
    assert returns(three, out) == want
    assert grown(three, {1}) == (0, 1, 2, 3) and grown(four, {1}) == (0, 1, 2, 3)


def test_returns_are_decided_after_the_losses_keyed_by_the_resulting_set_and_only_for_their_layout():
    ctx, four, three = layouts()
    order = []

    def replan(failed, c, strategy, steps_left):
        order.append(("loss", failed, steps_left))
        return c

    def grow(joining, c, strategy, steps_left):
        order.append(("return", joining, steps_left))
        if joining == {5}:
            raise HspmdError("no plan with it")
        return None if joining == {6} else four.ctx  # 6: stay spare

    p = Preplanner(replan, grow)
    p.begin(three, [frozenset({2})], frozenset({1}), 9, [frozenset({1}), frozenset({5}), frozenset({6}),
                                                          frozenset({3})])
    wait_for(lambda: p.notes())
    # device 3 is in the layout: no return; a return joins after the next step, one step fewer to gain on
    assert order == [("loss", frozenset({1, 2}), 9), ("return", frozenset({1}), 8), ("return", frozenset({5}), 8),
                     ("return", frozenset({6}), 8)]
    assert p.lookup_return(three, {1}).context is four.ctx
    assert p.lookup_return(three, {6}).context is None  # decided ahead: stay
    assert p.lookup_return(three, {5}) is None and p.lookup_return(three, {1, 6}) is None  # not decided ahead
    assert p.lookup_return(four, {1}) is None  # another layout
    assert p.lookup(three, {2}) is not None and p.lookup(three, {1}) is None  # losses keep their own keys
    p.begin(four, [], frozenset(), 5, [frozenset({6})])
    wait_for(lambda: p.notes())
    assert p.lookup_return(three, {1}) is None  # replaced with the layout
    assert Preplanner(replan).lookup_return(three, {1}) is None  # without a grower nothing is decided ahead


def test_close_waits_for_the_replan_in_flight_and_starts_no_other():
    """A run that ends (finished or failing) closes the preplanner before the process may exit: a daemon thread
    left inside the solver at exit aborted the process (SIGABRT) after an unrecoverable failure was reported."""
    _, four, _ = layouts()
    inside, release, asked = threading.Event(), threading.Event(), []

    def replan(failed, c, strategy, steps_left):
        asked.append(failed)
        inside.set()
        release.wait(10.0)
        return c

    p = Preplanner(replan)
    p.begin(four, [frozenset({1}), frozenset({2})], frozenset(), 5)
    assert inside.wait(10.0)
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 >= 0.2   # it waited for the replan in flight ...
    assert not any(t.name == "hspmd-preplan" and t.is_alive() for t in threading.enumerate())
    assert asked == [frozenset({1})]        # ... and started no other
    assert p.lookup(four, {1}) is None       # whose result is dropped, as after ``stop``

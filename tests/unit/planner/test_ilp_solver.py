"""The one solver entry point: HiGHS by default, CBC as fallback, the same optimum from both; the
solution status (not PuLP's problem status) decides whether a solution is there."""

from __future__ import annotations

import itertools

import pulp
import pytest

from runtime.torchfree.solver import make_solver, solve, var


def knapsack() -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    values, weights = [10, 13, 7, 8, 4], [5, 6, 3, 4, 2]
    prob = pulp.LpProblem("knapsack", pulp.LpMaximize)
    x = [var(prob, f"x{i}", cat="Binary") for i in range(5)]
    prob += pulp.lpSum(w * xi for w, xi in zip(weights, x)) <= 10
    prob += pulp.lpSum(v * xi for v, xi in zip(values, x))
    return prob, x


def brute() -> int:
    values, weights = [10, 13, 7, 8, 4], [5, 6, 3, 4, 2]
    return max(sum(v for v, b in zip(values, bits) if b) for bits in itertools.product((0, 1), repeat=5)
               if sum(w for w, b in zip(weights, bits) if b) <= 10)


@pytest.mark.parametrize("prefer", ["highs", "cbc"])
def test_both_solvers_find_the_optimum(prefer):
    prob, _ = knapsack()
    res = solve(prob, 10.0, prefer=prefer)
    assert res.ok
    # PuLP's bundled CBC has once (in a full-suite run; not reproduced in 60 runs alone) written this optimum as
    # "Stopped on time", which PuLP reads as feasible-not-proven; the value is what both must get right.
    assert res.optimal or prefer == "cbc"
    assert pulp.value(prob.objective) == brute()


def test_default_is_highs_and_quiet():
    solver = make_solver(5.0)
    assert isinstance(solver, pulp.HiGHS)
    assert solver.msg is False and solver.timeLimit == 5.0
    assert isinstance(make_solver(5.0, prefer="cbc"), pulp.PULP_CBC_CMD)


def test_infeasible_problem_is_not_ok():
    prob = pulp.LpProblem("infeasible", pulp.LpMinimize)
    x = var(prob, "x", 0, 1, cat="Integer")
    prob += x >= 2
    prob += x
    for prefer in ("highs", "cbc"):
        assert not solve(prob, 5.0, prefer=prefer).ok


def test_objective_bound_prunes_to_nothing_when_the_bound_is_already_optimal():
    # Minimize x with x >= 3: the bound 3 - 1 admits no solution, which is reported as "no solution".
    prob = pulp.LpProblem("bounded", pulp.LpMinimize)
    x = var(prob, "x", 0, 10, cat="Integer")
    prob += x >= 3
    prob += x
    assert solve(prob, 5.0).ok
    prob2 = pulp.LpProblem("bounded2", pulp.LpMinimize)
    y = var(prob2, "y", 0, 10, cat="Integer")
    prob2 += y >= 3
    prob2 += y
    assert not solve(prob2, 5.0, objective_bound=2.0).ok


def test_highs_solve_error_falls_back_to_cbc():
    """A micro-batch ILP on which HiGHS finds the optimum, then rejects it (a big-M row violated by 1e-6:
    "solve error"); the fallback must still return the optimum (found by hypothesis)."""
    from planner.microbatch import PipelineClass, TimeOption, allocate_ilp

    classes = [PipelineClass((TimeOption(2.0, 0.0),), 2, 1),
               PipelineClass((TimeOption(3.0, 2.936330171407854), TimeOption(3.117352539916251, 0.0)), 2, 2)]
    got = allocate_ilp(classes, 9)
    assert got is not None
    # Best by hand: the second class's copies take 3 + 3 (or 3 + 2) micro-batches on its second option
    # (3 x 3.117 s), the first class the rest (3 or 4: at most 8 s).
    assert got.option[1] == 1 and max(got.per_class[1]) == 3 and sum(map(sum, got.per_class)) == 9
    assert got.makespan_s == pytest.approx(3 * 3.117352539916251)

"""The one place hspmd gets an ILP solver: PuLP with HiGHS (highspy), bundled CBC as fallback.

It lives in runtime/ because the runtime's per-step dispatch solves small ILPs and must not import
the planner; the planner uses it from here.

``solve(problem, time_limit)`` returns whether PuLP holds a usable solution. On a time limit PuLP's
``status`` may still read Optimal while only a feasible (or no) solution exists: ``sol_status`` is what
says which, so that is what is checked.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import warnings
from dataclasses import dataclass

import pulp


@functools.cache  # once per process: only the first solver object prints it
def _silence_highs_banner() -> None:
    """HiGHS prints a copyright banner on stdout from C++ the first time a solver object is built in a
    process, before ``output_flag`` can be set; that would corrupt ``--format json`` output. Build that
    first object with file descriptor 1 pointed at /dev/null."""
    try:
        import highspy
    except ImportError:
        return
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
            libc.fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def make_solver(time_limit: float | None = None, *, prefer: str = "highs",
                objective_bound: float | None = None) -> pulp.LpSolver:
    """A quiet, single-threaded (hence deterministic) MILP solver with a time limit in seconds.

    HiGHS through highspy when importable, else PuLP's bundled CBC. ``prefer="cbc"`` forces CBC.
    ``objective_bound``: a known upper bound on a minimization's optimum (a heuristic's value), which lets
    HiGHS prune its search; solutions above it are not reported.
    """
    limit = None if time_limit is None else max(0.01, float(time_limit))
    if prefer == "highs" and pulp.HiGHS().available():
        _silence_highs_banner()
        extra = {} if objective_bound is None else {"objective_bound": float(objective_bound)}
        return pulp.HiGHS(msg=False, threads=1, timeLimit=limit, **extra)
    # PuLP 3.x bundles CBC as PULP_CBC_CMD and warns that PuLP 4 will drop it (use COIN_CMD with
    # ``pulp[cbc]`` then); the fallback is what it is for, so the warning is not passed on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, threads=1, timeLimit=limit)


def var(problem: pulp.LpProblem, name: str, low: float | None = None, up: float | None = None,
        cat: str = "Continuous") -> pulp.LpVariable:
    """A variable attached to ``problem`` (PuLP >= 3.3 wants them created through the problem)."""
    if hasattr(problem, "add_variable"):
        return problem.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


@dataclass(frozen=True)
class SolveResult:
    ok: bool          # a feasible integer solution is loaded into the problem's variables
    optimal: bool     # ... and proven optimal (False when the time limit cut the search short)
    status: str       # PuLP's words for it


def solve(problem: pulp.LpProblem, time_limit: float | None = None, *, prefer: str = "highs",
          objective_bound: float | None = None) -> SolveResult:
    """Solve ``problem`` in place; fall back to CBC if HiGHS errors out or gives up on numerics."""
    try:
        problem.solve(make_solver(time_limit, prefer=prefer, objective_bound=objective_bound))
        failed = prefer != "cbc" and _highs_solve_error(problem)
    except (pulp.PulpSolverError, IndexError):
        # IndexError: PuLP's HiGHS adapter reading back a solution HiGHS did not produce (coefficients
        # many orders of magnitude apart, e.g. from a cluster file's 1e-30 TFLOPS).
        if prefer == "cbc":
            raise
        failed = True
    if failed:
        with contextlib.suppress(AttributeError):
            problem.solverModel = None
        problem.solve(make_solver(time_limit, prefer="cbc"))
    sol = problem.sol_status
    ok = sol in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    return SolveResult(ok=ok, optimal=sol == pulp.LpSolutionOptimal, status=pulp.LpSolution[sol])


def _highs_solve_error(problem: pulp.LpProblem) -> bool:
    """HiGHS can find an optimum, then refuse it when its final check sees a primal infeasibility at the
    tolerance (big-M rows): it reports "solve error" and PuLP "not solved". CBC accepts such solutions."""
    model = getattr(problem, "solverModel", None)
    if model is None or not hasattr(model, "getModelStatus"):
        return False
    import highspy

    return model.getModelStatus() == highspy.HighsModelStatus.kSolveError

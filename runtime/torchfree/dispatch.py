"""Per-step dispatch of documents of mixed length: which strategy serves the step, and which pipeline and
micro-batch each document goes to.

A pure, deterministic function of the step's document lengths and the strategies' cost models: every rank
computes it identically, so nothing is communicated (floats are summed in a fixed order, ties broken by
index, the ILP solved single-threaded with no time limit; no sets, no hashing of strings).

The model (docs/lengths.md): a document of s tokens costs ``a*s^2 + b*s + c`` on a stage, plus the stage's
``microbatch_overhead`` once per micro-batch (the one reason to put several documents in one); a pipeline's
time is ``pipeline_time``; a micro-batch holds at most ``PipelineCost.capacity`` tokens (1F1B keeps S - k of
them in flight on stage k); a document is never split. Exact (ILP) when the instance is small
(``EXACT_MAX_BINARIES``), else greedy LPT with a proven bound on its gap (``Assignment.gap_bound``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from runtime.torchfree.errors import Checker, InfeasibleError
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Strategy, TrainingSettings

Method = Literal["auto", "ilp", "greedy"]
# The ILP has P * D * (D + 1) / 2 assignment binaries (D documents, P pipelines); up to this many it solves in
# well under a second on one core (measured: 6 documents on 3 pipelines of 3 stages with overheads, 0.7 s at
# worst), beyond it the time grows fast (8 documents on 4 such pipelines: up to 15 s), so LPT takes over.
EXACT_MAX_BINARIES = 64
# What "optimal" means for the ILP: HiGHS' default relative MIP gap 1e-4 plus its absolute gap 1e-6 on an
# objective scaled by the lower bound (so >= 1); CBC's defaults are tighter.
ILP_GAP_BOUND = 1.0 + 1e-4 + 1e-6


# ---------------------------------------------------------------------------------------------------------
# Cost model


@dataclass(frozen=True)
class CostModel:
    """Seconds one document of s tokens costs: ``a*s^2 + b*s + c`` (non-negative, so longer never costs less)."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0

    def __post_init__(self) -> None:
        with Checker() as ck:
            ck.each(self, ("a", "b", "c"), lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v >= 0, "must be a finite number >= 0")

    def __call__(self, s: int) -> float:
        return (self.a * s + self.b) * s + self.c

    def __add__(self, other: CostModel) -> CostModel:
        return CostModel(self.a + other.a, self.b + other.b, self.c + other.c)

    @staticmethod
    def total(layers: Sequence[CostModel]) -> CostModel:
        """A stage's model from its layers' (the sum, in layer order)."""
        return sum(layers, CostModel())


@dataclass(frozen=True)
class StageCost:
    cost: CostModel
    activation_budget_tokens: int
    microbatch_overhead: float = 0.0

    def __post_init__(self) -> None:
        with Checker() as ck:
            ck.check(isinstance(self.cost, CostModel), "cost", "must be a CostModel")
            ck.check(isinstance(self.activation_budget_tokens, int) and self.activation_budget_tokens >= 1,
                     "activation_budget_tokens", f"must be an integer >= 1, got {self.activation_budget_tokens!r}")
            ck.check(math.isfinite(self.microbatch_overhead) and self.microbatch_overhead >= 0, "microbatch_overhead",
                     f"must be a finite number >= 0, got {self.microbatch_overhead!r}")

    def time(self, lengths: Sequence[int]) -> float:
        """This stage's time for one micro-batch of documents (0 for an empty one)."""
        return sum((self.cost(s) for s in lengths), self.microbatch_overhead) if lengths else 0.0


@dataclass(frozen=True)
class PipelineCost:
    stages: tuple[StageCost, ...]

    def __post_init__(self) -> None:
        with Checker() as ck:
            if not self.stages:
                ck.add("stages", "a pipeline needs at least one stage")
            n = len(self.stages)
            for k, st in enumerate(self.stages):
                ck.check(st.activation_budget_tokens >= n - k, f"stages[{k}].activation_budget_tokens",
                         f"{st.activation_budget_tokens} tokens cannot hold one token of each of the {n - k} "
                         f"micro-batches stage {k} keeps in flight under 1F1B")

    @property
    def capacity(self) -> int:
        """The most tokens one micro-batch may hold: every stage keeps S - k of them in flight."""
        n = len(self.stages)
        return min(st.activation_budget_tokens // (n - k) for k, st in enumerate(self.stages))

    def stage_times(self, microbatches: Sequence[Sequence[int]]) -> list[list[float]]:
        """[micro-batch][stage] times for micro-batches given as their documents' lengths."""
        return [[st.time(mb) for st in self.stages] for mb in microbatches]

    def time(self, microbatches: Sequence[Sequence[int]]) -> float:
        return pipeline_time(self.stage_times(microbatches))


@dataclass(frozen=True)
class StrategyCost:
    """One strategy as dispatch sees it: the longest document it serves and its pipelines' cost models."""

    name: str
    max_seq_len: int
    pipelines: tuple[PipelineCost, ...]

    def __post_init__(self) -> None:
        with Checker() as ck:
            ck.check(bool(self.name), "name", "must not be empty")
            ck.check(isinstance(self.max_seq_len, int) and self.max_seq_len >= 1, "max_seq_len",
                     f"must be an integer >= 1, got {self.max_seq_len!r}")
            ck.check(bool(self.pipelines), "pipelines", "a strategy needs at least one pipeline")

    def holds(self, longest: int) -> bool:
        """Serves a step whose longest document has ``longest`` tokens (length range and some pipeline's memory)."""
        return longest <= self.max_seq_len and longest <= max(p.capacity for p in self.pipelines)


def pipeline_time(stage_times: Sequence[Sequence[float]]) -> float:
    """Modelled 1F1B time of one pipeline for micro-batches of varying cost; ``stage_times[j][k]`` is micro-batch
    j's forward + backward time on stage k.

    ``max over k of ( sum_j t[j][k] + sum over k' != k of max_j t[j][k'] )``: the bottleneck stage k works
    through every micro-batch, and the other stages add one micro-batch each for filling and draining the
    pipeline, taken at their largest (the schedule may put any micro-batch first or last). For m equal
    micro-batches it is the familiar ``(m - 1) * max_k t_k + sum_k t_k``. Order-free, so dispatch need not
    choose an order; the ILP below minimises exactly this expression. The planner and the simulator should
    import this function rather than restate the formula.
    """
    if not stage_times:
        return 0.0
    n = len(stage_times[0])
    if n == 0 or any(len(row) != n for row in stage_times):
        raise ValueError("stage_times: every micro-batch needs one time per stage, and there is at least one stage")
    col_sum = [0.0] * n
    col_max = [0.0] * n
    for row in stage_times:
        for k, t in enumerate(row):
            if not t >= 0:
                raise ValueError(f"stage_times: {t!r} is not a time >= 0")
            col_sum[k] += t
            col_max[k] = max(col_max[k], t)
    fill = sum(col_max)
    return max(col_sum[k] + fill - col_max[k] for k in range(n))


# ---------------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class PipelineLoad:
    microbatches: tuple[tuple[int, ...], ...]     # indices into the step's documents, ascending per micro-batch
    tokens: tuple[int, ...]                        # per micro-batch
    time: float                                    # pipeline_time of these micro-batches


@dataclass(frozen=True)
class Assignment:
    """Documents placed on one strategy's pipelines. ``makespan <= gap_bound * optimum`` is proven: 1 + the
    solver's relative gap for the ILP; for greedy the smaller of LPT's a-priori ratio (where it applies) and
    ``makespan / lower_bound``."""

    pipelines: tuple[PipelineLoad, ...]
    makespan: float
    lower_bound: float
    gap_bound: float
    method: Literal["ilp", "greedy"]

    @property
    def imbalance(self) -> float:
        """Slowest / mean predicted pipeline time (1 = balanced)."""
        mean = sum(p.time for p in self.pipelines) / len(self.pipelines)
        return self.makespan / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Dispatch:
    strategy: int                          # index into the strategies given
    strategy_name: str
    assignment: Assignment
    predicted: tuple[float | None, ...]    # per strategy its makespan for this step, None where it cannot serve it
    cheapest: int | None = None            # the strategy with the smallest makespan (None: the same as strategy)
    switch_cost: float = 0.0               # modelled seconds of moving the state to ``strategy`` (0: no switch)


# ---------------------------------------------------------------------------------------------------------
# Dispatch


def dispatch(lengths: Sequence[int], strategies: Sequence[StrategyCost], *, method: Method = "auto",
             exact_max_binaries: int = EXACT_MAX_BINARIES, current: int | None = None,
             switch_cost: SwitchCost | None = None) -> Dispatch:
    """Pick the strategy with the smallest predicted step time among those that hold the step's longest
    document (ties: the first given), with its assignment of documents to pipelines and micro-batches.

    With ``current`` (the strategy the previous step ran) and ``switch_cost`` (modelled seconds of moving the
    state from strategy i to j), the choice has hysteresis (``choose``): a switch is taken only when it pays.
    """
    if not strategies:
        raise ValueError("dispatch needs at least one strategy")
    check_lengths(lengths)
    longest = max(lengths, default=0)
    assignments = [assign(lengths, s.pipelines, method=method, exact_max_binaries=exact_max_binaries)
                   if s.holds(longest) else None for s in strategies]
    predicted = [None if a is None else a.makespan for a in assignments]
    if all(p is None for p in predicted):
        served = ", ".join(f"{s.name} up to {min(s.max_seq_len, max(p.capacity for p in s.pipelines))}"
                           for s in strategies)
        raise InfeasibleError(f"no strategy holds the step's longest document ({longest} tokens): {served}")
    cheapest = cheapest_of(predicted)
    i = choose(predicted, current, switch_cost)
    a = assignments[i]
    assert a is not None
    cost = 0.0 if current is None or i == current or switch_cost is None else switch_cost(current, i)
    return Dispatch(i, strategies[i].name, a, tuple(predicted), cheapest if cheapest != i else None, cost)


class SwitchCost(Protocol):
    def __call__(self, src: int, dst: int) -> float:
        """Modelled seconds of moving the training state from strategy ``src`` to ``dst``."""
        ...


def cheapest_of(predicted: Sequence[float | None]) -> int:
    """The strategy with the smallest predicted makespan (ties: the first)."""
    best = min((i for i, p in enumerate(predicted) if p is not None), key=lambda i: predicted[i], default=None)
    if best is None:
        raise ValueError("no strategy can serve the step")
    return best


def choose(predicted: Sequence[float | None], current: int | None, switch_cost: SwitchCost | None) -> int:
    """The strategy a step runs, with hysteresis against switching.

    Keep ``current`` while it can serve the step, unless the cheapest strategy's modelled gain on this step,
    ``predicted[current] - predicted[cheapest]``, exceeds the modelled cost of moving the state there
    (``switch_cost(current, cheapest)``). Must the run leave ``current`` (the step holds a document longer
    than it serves), it goes to the cheapest strategy whatever the cost. One step of look-ahead: the gain of
    later steps on the new strategy is not counted, so a switch is only taken when it pays for itself at
    once, and the run cannot flap between two strategies whose times differ by less than a switch.
    Without ``current`` (the first step) or ``switch_cost``: the cheapest.
    """
    best = cheapest_of(predicted)
    if current is None or switch_cost is None or best == current:
        return best
    now = predicted[current]
    if now is None:
        return best
    gain = now - predicted[best]  # type: ignore[operator]
    return best if gain > switch_cost(current, best) else current


def check_lengths(lengths: Sequence[int]) -> None:
    for i, s in enumerate(lengths):
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"lengths[{i}]: a document length is an integer >= 1, got {s!r}")


def assign(lengths: Sequence[int], pipelines: Sequence[PipelineCost], *, method: Method = "auto",
           exact_max_binaries: int = EXACT_MAX_BINARIES) -> Assignment:
    """Place every document on a pipeline and micro-batch, minimising the slowest pipeline's ``pipeline_time``
    under every stage's memory. ILP when ``method`` is ilp, or auto with at most ``exact_max_binaries``
    assignment binaries; greedy LPT otherwise (and when the solver reports no proven optimum)."""
    check_lengths(lengths)
    if not pipelines:
        raise ValueError("assign needs at least one pipeline")
    caps = [p.capacity for p in pipelines]
    for i, s in enumerate(lengths):
        if s > max(caps):
            raise InfeasibleError(f"document {i} ({s} tokens) fits no pipeline's micro-batch memory "
                                  f"(largest holds {max(caps)} tokens)")
    lb = lower_bound(lengths, pipelines)
    greedy = greedy_assign(lengths, pipelines)
    n = len(lengths)
    fallback = finish(lengths, pipelines, greedy, lb, "greedy")
    if method == "greedy" or not n or (method == "auto" and len(pipelines) * n * (n + 1) // 2 > exact_max_binaries):
        return fallback
    exact = ilp_assign(lengths, pipelines, scale=lb if lb > 0 else 1.0, lower=lb, upper=fallback.makespan)
    if exact is None:
        return fallback
    solved = finish(lengths, pipelines, exact, lb, "ilp")
    # Within the solver's gap the greedy layout may be the (slightly) better one; it is then as proven.
    if fallback.makespan < solved.makespan:
        return Assignment(fallback.pipelines, fallback.makespan, lb, solved.gap_bound, "ilp")
    return solved


def finish(lengths: Sequence[int], pipelines: Sequence[PipelineCost], layout: list[list[list[int]]], lb: float,
           method: Literal["ilp", "greedy"]) -> Assignment:
    """Canonical order (micro-batches by decreasing tokens, then first document) and the modelled times."""
    loads = []
    for p, mbs in zip(pipelines, layout):
        mbs = sorted((sorted(mb) for mb in mbs if mb), key=lambda mb: (-sum(lengths[d] for d in mb), mb[0]))
        by_len = [[lengths[d] for d in mb] for mb in mbs]
        loads.append(PipelineLoad(tuple(tuple(mb) for mb in mbs), tuple(sum(x) for x in by_len), p.time(by_len)))
    makespan = max(ld.time for ld in loads)
    posterior = makespan / lb if lb > 0 else 1.0
    gap = min(posterior, ILP_GAP_BOUND if method == "ilp" else a_priori_bound(lengths, pipelines))
    return Assignment(tuple(loads), makespan, lb, max(1.0, gap), method)


def greedy_assign(lengths: Sequence[int], pipelines: Sequence[PipelineCost]) -> list[list[list[int]]]:
    """LPT: documents longest first; each goes where its pipeline's modelled time after placing it is smallest
    - a new micro-batch, or an existing one with room (preferred on a tie: one overhead fewer). Ties then by
    pipeline index and micro-batch index. With one-stage identical pipelines this is exactly Graham's LPT."""
    order = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))
    caps = [p.capacity for p in pipelines]
    layout: list[list[list[int]]] = [[] for _ in pipelines]
    tokens: list[list[int]] = [[] for _ in pipelines]
    times: list[list[list[float]]] = [[] for _ in pipelines]      # [pipeline][micro-batch][stage]
    col_sum = [[0.0] * len(p.stages) for p in pipelines]
    col_max = [[0.0] * len(p.stages) for p in pipelines]

    def after(p: int, add: list[float], j: int | None) -> float:
        """Pipeline p's time with ``add`` put on micro-batch j (None: a new one)."""
        base = times[p][j] if j is not None else [0.0] * len(add)
        sums = [col_sum[p][k] + add[k] for k in range(len(add))]
        maxs = [max(col_max[p][k], base[k] + add[k]) for k in range(len(add))]
        fill = sum(maxs)
        return max(sums[k] + fill - maxs[k] for k in range(len(add)))

    for d in order:
        s = lengths[d]
        best: tuple[float, int, int, int, list[float]] | None = None
        for p, pipe in enumerate(pipelines):
            if s > caps[p]:
                continue
            doc = [st.cost(s) for st in pipe.stages]
            for j in range(len(layout[p])):
                if tokens[p][j] + s <= caps[p]:
                    cand = (after(p, doc, j), p, 0, j, doc)
                    if best is None or cand[:4] < best[:4]:
                        best = cand
            new = [doc[k] + st.microbatch_overhead for k, st in enumerate(pipe.stages)]
            cand = (after(p, new, None), p, 1, len(layout[p]), new)
            if best is None or cand[:4] < best[:4]:
                best = cand
        assert best is not None  # assign() checked that every document fits some pipeline
        _, p, _, j, add = best
        if j == len(layout[p]):
            layout[p].append([])
            tokens[p].append(0)
            times[p].append([0.0] * len(add))
        layout[p][j].append(d)
        tokens[p][j] += s
        for k, t in enumerate(add):
            times[p][j][k] += t
            col_sum[p][k] += t
            col_max[p][k] = max(col_max[p][k], times[p][j][k])
    return layout


def lower_bound(lengths: Sequence[int], pipelines: Sequence[PipelineCost]) -> float:
    """A proven lower bound on the optimal makespan, the larger of two:

    * every document runs somewhere, and a pipeline's time never falls when work is added, so the optimum is
      at least, for every document, its cheapest pipeline's time for it alone;
    * work: pipeline p's time is at least the total cost of its documents on any one fixed stage k_p (we take
      the stage with most total work). Let u_p(d) be that cost, rho_d = min_p u_p(d) and
      kappa_p = min_d u_p(d) / rho_d (>= 1, "how much slower than the best p is, at least"). Then
      sum_{d on p} rho_d <= z / kappa_p, and summing over p: z >= sum_d rho_d / sum_p 1/kappa_p. For identical
      pipelines this is the average load; for pipelines of different speeds, total work / total speed.
    """
    if not lengths:
        return 0.0
    caps = [p.capacity for p in pipelines]
    alone = max(min(sum(st.cost(s) + st.microbatch_overhead for st in p.stages)
                    for p, cap in zip(pipelines, caps) if s <= cap) for s in lengths)
    u: list[list[float | None]] = []
    for p, cap in zip(pipelines, caps):
        totals = [sum(st.cost(s) for s in lengths) for st in p.stages]
        k = max(range(len(totals)), key=lambda i: (totals[i], -i))
        u.append([p.stages[k].cost(s) if s <= cap else None for s in lengths])
    rho = [min(row[d] for row in u if row[d] is not None) for d in range(len(lengths))]
    inv_kappa = 0.0
    for row in u:
        ratios = [row[d] / rho[d] for d in range(len(lengths)) if row[d] is not None and rho[d] > 0]
        if ratios:
            inv_kappa += 1.0 / min(ratios)
    work = sum(rho) / inv_kappa if inv_kappa > 0 else 0.0
    return max(alone, work)


def a_priori_bound(lengths: Sequence[int], pipelines: Sequence[PipelineCost]) -> float:
    """LPT's worst-case ratio where the problem is a classical one, else infinity.

    One stage per pipeline, no micro-batch overhead and every document fitting every pipeline make micro-batching
    irrelevant (a pipeline's time is the sum of its documents' costs): identical pipelines are P||Cmax, where
    Graham proved LPT within 4/3 - 1/(3m); pipelines whose cost models are proportional (different speeds)
    are Q||Cmax, where LPT (to the machine that finishes first) is within 2m/(m+1) (Gonzalez, Ibarra and
    Sahni, 1977; cited, not re-proved here).
    """
    m = len(pipelines)
    if any(len(p.stages) != 1 or p.stages[0].microbatch_overhead > 0 for p in pipelines):
        return math.inf
    if lengths and max(lengths) > min(p.capacity for p in pipelines):
        return math.inf
    models = [p.stages[0].cost for p in pipelines]
    if all(c == models[0] for c in models):
        return 4 / 3 - 1 / (3 * m)
    ref = (models[0].a, models[0].b, models[0].c)

    def proportional(vec: tuple[float, float, float]) -> bool:
        """vec = r * ref for one r > 0: cross-products vanish, the zero pattern is equal."""
        return all((x == 0) == (y == 0) for x, y in zip(vec, ref)) and all(
            math.isclose(vec[i] * ref[j], vec[j] * ref[i], rel_tol=1e-12) for i in range(3) for j in range(3))

    return 2 * m / (m + 1) if all(proportional((c.a, c.b, c.c)) for c in models[1:]) else math.inf


def ilp_assign(lengths: Sequence[int], pipelines: Sequence[PipelineCost], *, scale: float, lower: float = 0.0,
               upper: float | None = None) -> list[list[list[int]]] | None:
    """The exact assignment, or None when the solver proves nothing (then the caller keeps the greedy one).

    Binary x[d,p,j]: document d in micro-batch slot j of pipeline p. Slots are symmetric, so we only allow
    slot j for the documents of rank >= j in longest-first order (relabel a pipeline's micro-batches by their
    best-ranked member: the i-th then has a member of rank >= i); that removes the equivalent relabellings
    without losing any solution. y[p,j] marks a used slot where stages have a micro-batch overhead. M[p,k]
    bounds every slot's time on stage k, and z >= sum_j t[p,j,k] + sum_{k' != k} M[p,k'] is
    ``pipeline_time`` linearised. Costs are divided by ``scale`` so the solver sees numbers near 1. ``lower``
    (a proven lower bound) and ``upper`` (a known solution's makespan) only prune the search.
    """
    import pulp

    from runtime.torchfree.solver import solve, var

    n = len(lengths)
    order = sorted(range(n), key=lambda d: (-lengths[d], d))
    caps = [p.capacity for p in pipelines]
    prob = pulp.LpProblem("dispatch", pulp.LpMinimize)
    z = var(prob, "z", 0)
    x: dict[tuple[int, int, int], pulp.LpVariable] = {}
    for rank, d in enumerate(order):
        for p in range(len(pipelines)):
            if lengths[d] <= caps[p]:
                for j in range(rank + 1):
                    x[d, p, j] = var(prob, f"x_{d}_{p}_{j}", 0, 1, "Binary")
    prob += z
    for d in range(n):
        prob += pulp.lpSum(x[d, p, j] for p in range(len(pipelines)) for j in range(n) if (d, p, j) in x) == 1
    for p, pipe in enumerate(pipelines):
        slots = [[d for d in range(n) if (d, p, j) in x] for j in range(n)]
        overhead = any(st.microbatch_overhead > 0 for st in pipe.stages)
        y = {}
        for j, members in enumerate(slots):
            if not members:
                continue
            if sum(lengths[d] for d in members) > caps[p]:
                prob += pulp.lpSum(lengths[d] * x[d, p, j] for d in members) <= caps[p]
            if overhead:
                y[j] = var(prob, f"y_{p}_{j}", 0, 1, "Binary")
                for d in members:
                    prob += x[d, p, j] <= y[j]
        t = [[pulp.lpSum([st.cost(lengths[d]) / scale * x[d, p, j] for d in members]
                         + ([st.microbatch_overhead / scale * y[j]] if j in y else []))
              for st in pipe.stages] for j, members in enumerate(slots) if members]
        n_st = len(pipe.stages)
        big = [var(prob, f"m_{p}_{k}", 0) for k in range(n_st)] if n_st > 1 else []
        for k in range(len(big)):
            for row in t:
                prob += big[k] >= row[k]
        for k in range(n_st):
            prob += z >= pulp.lpSum(row[k] for row in t) + pulp.lpSum(big[kk] for kk in range(len(big)) if kk != k)
    bound = None if upper is None else upper / scale * (1 + 1e-6) + 1e-9
    result = solve(prob, objective_bound=bound)
    if not (result.ok and result.optimal):
        return None
    layout: list[list[list[int]]] = [[[] for _ in range(n)] for _ in pipelines]
    for (d, p, j), v in x.items():
        if (v.value() or 0) > 0.5:
            layout[p][j].append(d)
    return layout


# ---------------------------------------------------------------------------------------------------------
# A strategy's costs from its plan alone (what the runtime dispatches with when no profile is given)

# Per micro-batch and stage: launching one more forward and backward of each layer and one boundary message
# each way. A nominal figure (the planner's profiles measure it); it only needs to make an extra micro-batch
# cost something, so that short documents share one.
LAUNCH_S_PER_LAYER = 5e-5


def layer_cost(model: ModelSpec, tp: int, peak_flops: float) -> CostModel:
    """Forward + backward seconds of one decoder layer for one document of s tokens at ``peak_flops`` per
    device, its work split over ``tp`` devices: the projections' 6 * s * (matmul parameters) FLOPs (b) and
    causal attention's 6 * q_dim * s^2 (a: QK^T and AV, 2 * s^2 / 2 * q_dim multiply-adds each, x3 with the
    backward)."""
    h, f, q, kv = model.hidden_size, model.ffn_hidden_size, model.q_dim, model.kv_dim
    matmul = h * q + 2 * h * kv + q * h + 3 * h * f
    rate = peak_flops * tp
    return CostModel(6.0 * q / rate, 6.0 * matmul / rate, 0.0)


def head_cost(model: ModelSpec, tp: int, peak_flops: float) -> CostModel:
    """The output projection's forward + backward (the last stage's extra work)."""
    return CostModel(0.0, 6.0 * model.hidden_size * model.vocab_size / (peak_flops * tp), 0.0)


def tp_comm_cost(model: ModelSpec, tp: int, bandwidth_gbs: float) -> CostModel:
    """Megatron TP's all-reduces of one layer for s tokens: two in the forward, two in the backward, each of
    s x hidden fp32 values, a ring moving 2 (tp - 1) / tp of them over the group's slowest link."""
    if tp == 1:
        return CostModel()
    per_token = 4 * 2 * (tp - 1) / tp * model.hidden_size * 4
    return CostModel(0.0, per_token / (bandwidth_gbs * 1e9), 0.0)


def plan_strategy_cost(strategy: Strategy, model: ModelSpec, cluster: Cluster,
                       training: TrainingSettings) -> StrategyCost:
    """Dispatch's view of a plan's strategy from the plan alone: FLOPs at each stage's peak rate (its device
    type's ``peak_bf16_tflops``, which for emulated devices already carries their slowdown), TP's all-reduces
    at the group's slowest link, a nominal per-micro-batch launch cost, and memory sized as the plan sized it:
    a micro-batch of at most ``training.micro_batch x max_seq_len`` tokens, S - k of them in flight on stage k
    under 1F1B."""
    max_len = strategy.max_len_of(training)
    tokens = training.micro_batch * max_len
    pipes = []
    for pipe in strategy.pipelines:
        n = len(pipe.stages)
        stages = []
        for k, st in enumerate(pipe.stages):
            peak = min(cluster.type_of(d).peak_bf16_tflops for d in st.devices) * 1e12
            link = min((cluster.bandwidth_gbs(x, y) for x in st.devices for y in st.devices if x != y),
                       default=math.inf)
            layer = layer_cost(model, st.tp, peak) + tp_comm_cost(model, st.tp, link)
            cost = CostModel.total([layer] * st.num_layers)
            if k == n - 1:
                cost = cost + head_cost(model, st.tp, peak)
            stages.append(StageCost(cost, tokens * (n - k), LAUNCH_S_PER_LAYER * (st.num_layers + 1)))
        pipes.append(PipelineCost(tuple(stages)))
    return StrategyCost(strategy.name, max_len, tuple(pipes))

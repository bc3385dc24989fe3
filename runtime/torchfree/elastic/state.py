"""The model state of a run as data: which device holds which slice, what survives a failure, what a
switch between two plans moves.

The state is every parameter and its two AdamW moments, fp32, all three in the parameter's layout
(``DeviceProgram.local_state()``). A switch from plan A to plan B is one fused BSR of all of them
(runtime/torchfree/comm/bsr.py): each destination slice comes from a surviving holder in A, chosen for
bandwidth and load balance, and travels in one batched P2P round.

Under ZeRO-1 with r >= 2 copies (runtime/torchfree/engine/zero.py) A's moments are chunks of flattened slices,
not boxes of the parameter. A first fused BSR (``plan_moment_gather``) then rebuilds, on every
surviving replica of each slice, that slice's full moments from the surviving copies of its chunks
(a 1-D tensor per slice, the chunks an HSPMD union of duplicated parts); from there the switch is the
usual one, and a ZeRO-1 destination keeps its chunks of what it receives (runtime/elastic/move.py).
Why not one round: a chunk of a flattened slice is no box of the parameter, and B's boxes cut across
A's chunks; two rounds keep the BSR a planner of boxes. The price: during the switch each survivor
holds its full moments for a moment (what ``zero: false`` holds throughout). Everything here is pure (no
torch): the launcher checks a failure is survivable with it, ``hspmd replan`` prices
candidate plans with it, and every worker computes the same BSR plan from it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from runtime.torchfree.annotations.from_plan import strategy_annotations
from runtime.torchfree.annotations.states import Annotation, contains
from runtime.torchfree.comm.bsr import FLOAT32, BsrPlan, TensorMove, cells, plan_bsr, tensor_grid
from runtime.torchfree.engine.zero import ZeroSlice, strategy_zero_slices
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec import PlanContext
from runtime.torchfree.spec.handle import StrategyHandle

STATE_SUFFIXES = ("", ".exp_avg", ".exp_avg_sq")  # the parameter, then AdamW's two moments
MOMENT_SUFFIXES = STATE_SUFFIXES[1:]
STATE_DTYPE = FLOAT32  # master weights and moments (bf16 is only autocast compute)


def moment_key(name: str, suffix: str, i: int) -> str:
    """A ZeRO-1 moment's slice ``i`` as one 1-D tensor (the fused BSRs of a save and of a switch move these)."""
    return f"{name}{suffix}@{i}"


@dataclass(frozen=True)
class LostTensor:
    """A parameter (with its moments) of which some slice is held only by failed devices."""

    name: str
    holders: tuple[int, ...]  # every device that held any part of it
    lost_by: tuple[int, ...]  # the (failed) devices that held the missing slice
    layer: int | None = None  # its decoder layer (None: embedding, final norm, head)
    # ZeRO-1 moments: the lost chunk, (index, chunks of its slice); None for a parameter's slice
    chunk: tuple[int, int] | None = None

    def __str__(self) -> str:
        return f"{self.name} (a slice held only by failed device(s) {', '.join(map(str, self.lost_by))})"

    @property
    def piece(self) -> str:
        """Which piece was lost, as a line names it: '' (a slice of the parameter) or 'chunk 0 of 2 '."""
        return "" if self.chunk is None else f"chunk {self.chunk[0]} of {self.chunk[1]} "


def describe_lost(lost: list[LostTensor]) -> list[str]:
    """One line per run of decoder layers (and per other tensor) that lost every replica, with the
    devices that held it: 'decoder layers 1-4 (36 tensors): held only by device(s) 1'."""
    out: list[str] = []
    run: list[LostTensor] = []

    def flush() -> None:
        if run:
            first, last = run[0].layer, run[-1].layer
            where = f"decoder layer {first}" if first == last else f"decoder layers {first}-{last}"
            devs = sorted({d for t in run for d in t.lost_by})
            chunks = sorted({t.chunk for t in run if t.chunk is not None})
            piece = run[0].piece if len(chunks) <= 1 else f"chunks {', '.join(f'{i} of {m}' for i, m in chunks)} "
            out.append(f"{where} ({len(run)} tensors): {piece}held only by failed device(s) "
                       f"{', '.join(map(str, devs))}")
            run.clear()

    for t in lost:
        if t.layer is not None and run and t.layer - run[-1].layer > 1:
            flush()
        if t.layer is None:
            flush()
            out.append(f"{t.name}: {t.piece}held only by failed device(s) {', '.join(map(str, t.lost_by))}")
        else:
            run.append(t)
    flush()
    return out


def lost_tensors(ref: StrategyHandle, failed: Collection[int]) -> list[LostTensor]:
    """Parameters with a slice that no surviving device of ``ref`` holds (empty: the failure is
    survivable in memory). Needs only the plan: the launcher asks before it replans."""
    failed = frozenset(failed)
    ann = strategy_annotations(ref)
    out: list[LostTensor] = []
    verdict: dict[tuple[object, tuple[int, ...]], tuple[int, ...] | None] = {}
    for p in ann.params:
        key = (p.param, p.shape)
        if key not in verdict:
            verdict[key] = _missing_cell_holders(p.param.layout(p.shape), p.shape, failed)
        lost_by = verdict[key]
        if lost_by is not None:
            out.append(LostTensor(p.name, tuple(p.param.devices), lost_by, p.info.layer))
    return out


def lost_moments(ref: StrategyHandle, failed: Collection[int]) -> list[LostTensor]:
    """Parameters whose ZeRO-1 moments lost every copy of some chunk (``lost_by``: that chunk's holders).
    Empty without ZeRO-1 or when every chunk has a surviving holder."""
    failed = frozenset(failed)
    ann = strategy_annotations(ref)
    out: list[LostTensor] = []
    for name, sl in moment_slices(ref).items():
        gone = [(s.holders.index(h), len(s.holders), h) for s in sl for _, h in s.lost_chunks(failed)]
        if gone:
            i, m, lost_by = gone[0]
            holders = tuple(sorted({d for s in sl for h in s.holders for d in h}))
            out.append(LostTensor(name, holders, lost_by, ann.param(name).info.layer, (i, m)))
    return out


@dataclass(frozen=True)
class LostState:
    """What a failure takes with it for good: the parameters with a slice no survivor holds, and (ZeRO-1)
    those whose moments lost every copy of some chunk. Empty (false) when memory can recover. The one
    answer the coordinator (at run time) and ``hspmd replan`` (asked ahead) both give."""

    failed: tuple[int, ...]
    tensors: tuple[LostTensor, ...] = ()
    moments: tuple[LostTensor, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.tensors or self.moments)

    def what(self) -> str:
        """'29 parameter(s) have no surviving replica and the ZeRO-1 AdamW moments of ...'."""
        parts = [f"{len(self.tensors)} parameter(s) have no surviving replica"] if self.tensors else []
        if self.moments:
            parts.append(f"the ZeRO-1 AdamW moments of {len(self.moments)} parameter(s) lost every copy of a chunk")
        return " and ".join(parts)

    def details(self) -> list[str]:
        """One indented line per run of layers (and other tensor): which tensors, which piece, which devices."""
        return ([f"  {line}" for line in describe_lost(list(self.tensors))]
                + [f"  AdamW moments of {line}" for line in describe_lost(list(self.moments))])


def lost_state(ref: StrategyHandle, failed: Collection[int]) -> LostState:
    """Whether ``ref``'s state survives the loss of ``failed`` in memory, and if not, what is gone."""
    return LostState(tuple(sorted(set(failed))), tuple(lost_tensors(ref, failed)), tuple(lost_moments(ref, failed)))


def moment_slices(ref: StrategyHandle) -> dict[str, tuple[ZeroSlice, ...]]:
    """The strategy's ZeRO-1 layout (empty without ZeRO-1), derived once per handle."""
    return ref.cached(_zero_layout)


def _zero_layout(h: StrategyHandle) -> dict[str, tuple[ZeroSlice, ...]]:
    return strategy_zero_slices(strategy_annotations(h), h.training, h.cluster)


def plan_moment_gather(src: StrategyHandle, excluded: Iterable[int] = (), *,
                       ungathered: bool = False) -> BsrPlan | None:
    """The first round of a switch from a ZeRO-1 plan: every surviving replica of each sharded slice
    gets the slice's full moments (1-D, ``moment_key``) from the surviving copies of its chunks. None
    without ZeRO-1. Raises HspmdError when a chunk has no surviving copy (check ``lost_moments``).

    ``ungathered``: the committed step's parameter all-gather did not finish, so each slice's parameters are
    also rebuilt from its chunks' holders (who updated them; the other replicas may hold either step's
    values). That is the all-gather redone among the survivors, in the same round as the moments."""
    slices = moment_slices(src)
    if not slices:
        return None
    out = frozenset(excluded)
    suffixes = (STATE_SUFFIXES if ungathered else MOMENT_SUFFIXES)
    moves = []
    for name, sl in slices.items():
        for i, s in enumerate(sl):
            have = s.moment_annotation(out)
            if have is None:
                raise HspmdError(f"{name}: the ZeRO-1 moments of slice {i} have no surviving copy")
            want = Annotation.spmd([d for d in s.devices if d not in out])
            moves.extend(TensorMove(moment_key(name, suffix, i), (s.numel,), STATE_DTYPE, have, want)
                         for suffix in suffixes)
    return plan_bsr(moves, bandwidth=src.ctx.cluster, excluded=tuple(sorted(out)))


def holder_sets(ref: StrategyHandle) -> frozenset[frozenset[int]]:
    """Every distinct set of devices that are all the holders of some piece of the state (a grid cell of a
    parameter with its moments; under ZeRO-1, a moment chunk): the state is lost exactly when one of these
    sets dies whole. What the trace model prices the risk of an unrecoverable loss from."""
    ann = strategy_annotations(ref)
    out: set[frozenset[int]] = set()
    for key in {(p.param, p.shape) for p in ann.params}:
        out.update(frozenset(h) for h in _cell_holders(key[0].layout(key[1]), key[1]) if h)
    out.update(frozenset(h) for sl in moment_slices(ref).values() for s in sl for i, h in enumerate(s.holders)
               if s.chunk_bounds(i)[1] > s.chunk_bounds(i)[0])
    return frozenset(out)


def _cell_holders(layout, shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """The holders of each grid cell of a parameter's layout, cell by cell."""
    holdings = list(layout.holdings)
    cuts = tensor_grid((layout,), shape)
    full = tuple((0, n) for n in shape)
    for cell in cells(full, cuts):
        yield tuple(d for d, h in holdings if contains(h.region, cell))


def _missing_cell_holders(layout, shape: tuple[int, ...], failed: frozenset[int]) -> tuple[int, ...] | None:
    """The holders of the first grid cell no survivor holds, or None when every cell survives."""
    if not any(d in failed for d, _ in layout.holdings):
        return None
    return next((h for h in _cell_holders(layout, shape) if h and all(d in failed for d in h)), None)


def state_moves(src: StrategyHandle, dst: StrategyHandle) -> list[TensorMove]:
    """Every state tensor (parameter, exp_avg, exp_avg_sq) from its layout under ``src`` to ``dst``."""
    check_compatible(src.ctx, dst.ctx)
    old, new = strategy_annotations(src), strategy_annotations(dst)
    return [TensorMove(p.name + suffix, p.shape, STATE_DTYPE, p.param, new.param(p.name).param)
            for p in old.params for suffix in STATE_SUFFIXES]


def plan_switch(src: StrategyHandle, dst: StrategyHandle, excluded: Iterable[int] = ()) -> BsrPlan:
    """The fused BSR of a switch; ``excluded`` (failed) devices never send. Raises HspmdError naming a
    tensor when some slice has no surviving holder (check ``lost_tensors`` first for a full list)."""
    return plan_bsr(state_moves(src, dst), bandwidth=dst.ctx.cluster, excluded=tuple(sorted(set(excluded))))


def check_compatible(a: PlanContext, b: PlanContext) -> None:
    """Two plans can hand state to each other only if they train the same model the same way (the
    micro-batch size and schedule may differ: they do not change the numbers being computed, except for a
    mixture-of-experts model, whose balance loss and expert capacity are per forward)."""
    problems = []
    if a.model != b.model:
        problems.append(f"model {a.model.name} vs {b.model.name}")
    ta, tb = a.plan.training, b.plan.training
    same = ("global_batch", "seq_len", "seed", "optimizer") + (("micro_batch",) if a.model.moe is not None else ())
    for field in same:
        if getattr(ta, field) != getattr(tb, field):
            problems.append(f"training.{field} {getattr(ta, field)} vs {getattr(tb, field)}")
    for t in (ta, tb):
        if t.zero and t.zero_redundancy < 2:
            problems.append("training.zero: ZeRO-1 keeps one copy of each AdamW moment, an in-memory switch needs "
                            "two (zero_redundancy: 2) or full replicas (zero: false)")
            break
    if problems:
        raise HspmdError(f"{b.path}: cannot switch from {a.path} to this plan: " + "; ".join(problems))

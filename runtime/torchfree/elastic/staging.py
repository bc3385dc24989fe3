"""A switch between two strategies of one documents run, in stages, so that a device never holds both
strategies' states at once.

A documents run (runtime/launch/session.py ``DocumentSteps``) builds every strategy's program at start-up but
keeps the training state (parameters, AdamW moments) only in the strategy it is running; the others' tensors
have no storage. A switch from A to B moves the state one *unit* at a time (the embedding, a group of
consecutive decoder layers, the final norm and head: ``switch_units``), each unit one fused BSR
(runtime/torchfree/comm/bsr.py) of its parameters and moments: B's tensors of the unit are allocated and written in
place, then A's tensors of it are freed. A device's state bytes then go from A's to B's in steps of one unit,
and during unit u's stage it holds

    held before u  +  B's bytes of u  +  the stage's send and receive buffers

(``stage_peak``). The order of the units is chosen so that this stays low on every device
(``stage_order``): a device that gives up more than it receives in a unit wants that unit early, one that
receives more wants it late; the order is a greedy compromise over all devices, computed identically by
every worker (pure, no torch) and by the planner (planner/lengths.py), which prices a documents run's memory
with the same numbers: each strategy alone while it runs, and the switch's peak between steps (activations
and gradients are freed by then). Where every device's units all shrink or all grow (the same devices, or
nested layer ranges), any order stays within ``max(A, B) + one stage`` (``stage_bytes``); where devices
pull different ways (two stages swapping layers) the greedy order interleaves their units. ``peak`` is what
the chosen order actually reaches, and that is what is priced.

Why units of several layers and not single tensors: each stage is one batched P2P round with its latency;
``SWITCH_STAGES`` bounds the rounds while keeping a stage a small part of the state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from runtime.torchfree.annotations.from_plan import strategy_annotations
from runtime.torchfree.comm.bsr import BsrPlan, plan_bsr
from runtime.torchfree.elastic.state import STATE_SUFFIXES, state_moves
from runtime.torchfree.spec.handle import StrategyHandle

SWITCH_STAGES = 8   # decoder layers are cut into at most this many groups (plus embedding and head units)

UnitKind = Literal["embedding", "layers", "head"]


@dataclass(frozen=True)
class Unit:
    """What one stage of a switch moves: the embedding, decoder layers [first, stop), or the final norm and
    the head (a tied embedding is the embedding's)."""

    kind: UnitKind
    first: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        if self.kind == "layers" and not 0 <= self.first < self.stop:
            raise ValueError(f"a layer unit needs 0 <= first < stop, got [{self.first}, {self.stop})")

    def __str__(self) -> str:
        return f"layers {self.first}-{self.stop - 1}" if self.kind == "layers" else self.kind


def switch_units(num_layers: int) -> tuple[Unit, ...]:
    """The units of a switch of a model of ``num_layers`` decoder layers: the embedding, the layers in groups
    of ``ceil(num_layers / SWITCH_STAGES)`` consecutive ones, the head."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    per = math.ceil(num_layers / SWITCH_STAGES)
    layers = tuple(Unit("layers", a, min(a + per, num_layers)) for a in range(0, num_layers, per))
    return (Unit("embedding"), *layers, Unit("head"))


def unit_of(units: Sequence[Unit], owner: str, layer: int | None) -> int:
    """The index in ``units`` of a parameter by its owner (``ParamInfo.owner``) and decoder layer."""
    for i, u in enumerate(units):
        if u.kind == owner or (u.kind == "layers" and owner == "layer" and layer is not None
                               and u.first <= layer < u.stop):
            return i
    raise ValueError(f"no switch unit holds a parameter of owner {owner!r}, layer {layer}")


@dataclass(frozen=True)
class UnitBytes:
    """One unit on one device: the state bytes it holds of the unit in the source and in the destination
    layout, and the extra bytes its stage allocates while it runs (send and receive buffers)."""

    src: float
    dst: float
    buffers: float = 0.0

    def __post_init__(self) -> None:
        if min(self.src, self.dst, self.buffers) < 0:
            raise ValueError(f"unit bytes must be >= 0, got {self}")


UnitTable = Sequence[Mapping[int, UnitBytes]]   # per unit, per device that holds or receives any of it


def table_devices(table: UnitTable) -> list[int]:
    return sorted({d for row in table for d in row})


def start_bytes(table: UnitTable) -> dict[int, float]:
    """Per device the source strategy's state bytes (what it holds before the switch)."""
    return {d: sum(row[d].src for row in table if d in row) for d in table_devices(table)}


def end_bytes(table: UnitTable) -> dict[int, float]:
    return {d: sum(row[d].dst for row in table if d in row) for d in table_devices(table)}


def stage_bytes(b: UnitBytes) -> float:
    """What one stage may add on a device above ``max(A, B)`` when every unit shrinks its state there (the
    held bytes only fall: peak <= A + dst + buffers) or every unit grows it (peak <= B + src + buffers):
    the ``one stage`` of the bound ``max(A, B) + one stage``."""
    return max(b.src, b.dst) + b.buffers


def stage_peak(held: Mapping[int, float], row: Mapping[int, UnitBytes]) -> dict[int, float]:
    """Per device its bytes while a unit's stage runs: what it held before, the destination's tensors of the
    unit (allocated first, written in place) and the stage's buffers; the source's tensors of the unit are
    freed only after the stage."""
    return {d: h + (row[d].dst + row[d].buffers if d in row else 0.0) for d, h in held.items()}


def stage_order(table: UnitTable) -> tuple[int, ...]:
    """The order of the units: greedily, the next unit is the one whose stage keeps the worst device's excess
    over its own ``max(A, B)`` lowest (ties: the unit that leaves the least held, then the lowest index).
    Deterministic: every worker and the planner compute the same order."""
    devices = table_devices(table)
    base = {d: max(start_bytes(table)[d], end_bytes(table)[d]) for d in devices}
    held = start_bytes(table)
    left = list(range(len(table)))
    order = []
    while left:
        def score(u: int) -> tuple[float, float, int]:
            peak = stage_peak(held, table[u])
            after = {d: held[d] - table[u][d].src + table[u][d].dst if d in table[u] else held[d] for d in devices}
            return (max((peak[d] - base[d] for d in devices), default=0.0),
                    max((after[d] - base[d] for d in devices), default=0.0), u)

        u = min(left, key=score)
        left.remove(u)
        order.append(u)
        for d, b in table[u].items():
            held[d] += b.dst - b.src
    return tuple(order)


def switch_peak(table: UnitTable, order: Sequence[int]) -> dict[int, float]:
    """Per device the most bytes it holds at any point of the switch in ``order`` (its start and end
    included)."""
    held = start_bytes(table)
    peak = dict(held)
    for u in order:
        for d, v in stage_peak(held, table[u]).items():
            peak[d] = max(peak[d], v)
        for d, b in table[u].items():
            held[d] += b.dst - b.src
    return peak


def held_after(table: UnitTable, order: Sequence[int]) -> list[dict[int, float]]:
    """Per stage (in ``order``) each device's state bytes once the stage is done."""
    held = start_bytes(table)
    out = []
    for u in order:
        for d, b in table[u].items():
            held[d] += b.dst - b.src
        out.append(dict(held))
    return out


# ---------------------------------------------------------------------------------------------------------
# The runtime's switch plan


@dataclass(frozen=True)
class SwitchStage:
    """One stage of a staged switch: a unit's parameters (their ``local_state`` names; the BSR moves each with
    its two moments) and its fused BSR."""

    unit: Unit
    names: tuple[str, ...]
    bsr: BsrPlan


@dataclass(frozen=True)
class StagedSwitch:
    """A switch from one strategy's state layout to another's, stage by stage (in execution order)."""

    stages: tuple[SwitchStage, ...]
    table: tuple[Mapping[int, UnitBytes], ...]   # per stage (execution order), per device

    def modelled_time(self, bandwidth: object | None = None) -> float:
        """The stages run one after the other: the sum of their fused BSRs' modelled times."""
        return sum(s.bsr.modelled_time(bandwidth) for s in self.stages)

    def sent_bytes(self, device: int) -> int:
        return sum(m.nbytes for s in self.stages for m in s.bsr.sends(device))

    def peak(self) -> dict[int, float]:
        """Per device the most state and buffer bytes it holds during the switch (``switch_peak``)."""
        return switch_peak(self.table, range(len(self.table)))

    def held(self) -> list[dict[int, float]]:
        """Per stage each device's state bytes once the stage is done."""
        return held_after(self.table, range(len(self.table)))


def plan_staged_switch(src: StrategyHandle, dst: StrategyHandle) -> StagedSwitch:
    """The staged switch from ``src``'s layout to ``dst``'s: ``state_moves`` grouped by ``switch_units``, one
    fused BSR per unit, the units in ``stage_order`` of their bytes (the real tensors' fp32 bytes and each
    stage's send and receive buffers)."""
    units = switch_units(src.model.num_layers)
    ann = strategy_annotations(src)
    moves = state_moves(src, dst)
    by_unit: list[list] = [[] for _ in units]
    names: list[list[str]] = [[] for _ in units]
    for p in ann.params:
        names[unit_of(units, p.info.owner, p.info.layer)].append(p.name)
    unit_by_name = {p.name + suffix: unit_of(units, p.info.owner, p.info.layer)
                    for p in ann.params for suffix in STATE_SUFFIXES}
    for m in moves:
        by_unit[unit_by_name[m.name]].append(m)
    stages, table = [], []
    for u, ms in enumerate(by_unit):
        if not ms:
            continue
        bsr = plan_bsr(ms, bandwidth=dst.ctx.cluster)
        row: dict[int, UnitBytes] = {}
        for d in bsr.devices:
            held = [sum(math.prod(lay.local_shape(d)) * t.itemsize for t in bsr.tensors for lay in (getattr(t, side),)
                        if d in lay.devices) for side in ("src", "dst")]
            buffers = sum(m.nbytes for m in bsr.sends(d)) + sum(m.nbytes for m in bsr.recvs(d))
            row[d] = UnitBytes(float(held[0]), float(held[1]), float(buffers))
        stages.append(SwitchStage(units[u], tuple(names[u]), bsr))
        table.append(row)
    order = stage_order(table)
    return StagedSwitch(tuple(stages[u] for u in order), tuple(table[u] for u in order))

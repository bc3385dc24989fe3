"""Chaining TP groups into pipelines.

A *block* is a set of group kinds shared out over ``P`` pipelines as evenly as possible: pipeline i gets
``floor`` or ``ceil`` of ``g_k / P`` groups of each kind k (the extras of successive kinds are dealt out
round-robin from where the previous kind stopped, so no pipeline collects all of them). A block of one
kind gives pure pipelines (HSPMD's H800 and H20 pipelines); a block of several kinds gives mixed
pipelines (H2's chip-A stages followed by chip-B stages). Most pipelines of a big block are identical:
``template`` (the kinds in stage order) is what their costs depend on.

Stage order (H2): devices with more memory first, because under 1F1B stage k of S keeps ``S-k``
micro-batches of activations; ``order="speed"`` (fastest first) and ``order="fast_last"`` (slowest
first, so the fastest devices carry the final norm, head and loss, the heaviest extras) are tried as
alternatives.

Placement: ``contiguous`` gives each pipeline consecutive groups of a kind (consecutive stages share a
node: cheap stage-boundary transfers); ``interleaved`` deals groups round-robin, so that the groups at
the same stage position of different pipelines, which all-reduce their gradients together, share a node
(Megatron's tp-dp-pp rank order). The boundary transfers are paid per micro-batch but are small next to
a stage's compute; the gradient sync moves a stage's whole gradient once per step, so interleaving often
wins where pipelines are replicated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from planner.tp_groups import GroupKind, TPGroup

Template = tuple[GroupKind, ...]
ORDERS = ("memory", "speed", "fast_last")
PLACEMENTS = ("contiguous", "interleaved")


@dataclass(frozen=True)
class PipelineLayout:
    """One pipeline: its TP groups in stage order."""

    groups: tuple[TPGroup, ...]

    @property
    def template(self) -> Template:
        return tuple(g.kind for g in self.groups)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for g in self.groups for d in g.devices)


def share_out(counts: Mapping[GroupKind, int], pipelines: int) -> list[dict[GroupKind, int]] | None:
    """How many groups of each kind each pipeline gets; None if some pipeline would get none."""
    if pipelines < 1:
        return None
    out: list[dict[GroupKind, int]] = [{} for _ in range(pipelines)]
    offset = 0
    for kind in sorted(counts):
        q, r = divmod(counts[kind], pipelines)
        for i in range(pipelines):
            extra = 1 if (i - offset) % pipelines < r else 0
            if q + extra:
                out[i][kind] = q + extra
        offset = (offset + r) % pipelines
    if any(not p for p in out):
        return None
    return out


def distributions(counts: Mapping[GroupKind, int], pipelines: int, limit: int
                  ) -> list[list[dict[GroupKind, int]]] | None:
    """Every way to share the groups out to ``pipelines`` pipelines, each getting at least one, pipelines
    unordered (each way once, largest share first), in a fixed order; None when there are more than
    ``limit`` ways (the caller then deals evenly with ``share_out``). For small blocks: a 3 + 3 + 2 node
    cluster may want its pipelines as different as [a, a, b, c] and [a, b']."""
    kinds = sorted(k for k, n in counts.items() if n > 0)
    total = tuple(counts[k] for k in kinds)
    if pipelines < 1 or pipelines > sum(total):
        return [] if pipelines >= 1 else None
    vectors = sorted((v for v in itertools.product(*(range(n + 1) for n in total)) if any(v)), reverse=True)
    out: list[list[tuple[int, ...]]] = []

    def rec(left: tuple[int, ...], bins: int, cap: tuple[int, ...], acc: list[tuple[int, ...]]) -> bool:
        if bins == 1:
            if any(left) and left <= cap:
                out.append(acc + [left])
                return len(out) <= limit
            return True
        for v in vectors:
            if v > cap or any(x > y for x, y in zip(v, left)):
                continue
            rest = tuple(y - x for x, y in zip(v, left))
            if sum(rest) < bins - 1:
                continue
            if not rec(rest, bins - 1, v, acc + [v]):
                return False
        return True

    if not rec(total, pipelines, total, []):
        return None
    return [[{k: n for k, n in zip(kinds, v) if n} for v in way] for way in out]


def kind_order(kinds: Sequence[GroupKind], memory_gib: Callable[[GroupKind], float],
               layer_s: Callable[[GroupKind], float], order: str) -> list[GroupKind]:
    """Stage order of the kinds in a pipeline: ``memory`` (most memory per device first, then fastest),
    ``speed`` (fastest first) or ``fast_last`` (slowest first, the fastest last: it holds the head)."""
    if order == "memory":
        return sorted(kinds, key=lambda k: (-memory_gib(k), layer_s(k), k))
    if order == "speed":
        return sorted(kinds, key=lambda k: (layer_s(k), -memory_gib(k), k))
    if order == "fast_last":
        return sorted(kinds, key=lambda k: (-layer_s(k), -memory_gib(k), k))
    raise ValueError(f"unknown stage order {order!r}")


def deal(n_groups: int, shares: Sequence[int], placement: str) -> list[list[int]]:
    """Indices (into a kind's groups, in device order) each pipeline gets: ``contiguous`` runs, or
    ``interleaved`` round-robin (the r-th group of every pipeline taken side by side)."""
    if sum(shares) > n_groups:
        raise ValueError("more groups dealt than there are")
    if placement == "contiguous":
        out, start = [], 0
        for n in shares:
            out.append(list(range(start, start + n)))
            start += n
        return out
    if placement == "interleaved":
        out = [[] for _ in shares]
        nxt = 0
        for r in range(max(shares, default=0)):
            for i, n in enumerate(shares):
                if r < n:
                    out[i].append(nxt)
                    nxt += 1
        return out
    raise ValueError(f"unknown placement {placement!r}")


def build_pipelines(groups: Mapping[GroupKind, Sequence[TPGroup]], pipelines: int,
                    ranked: Sequence[GroupKind], placement: str = "contiguous",
                    shares: Sequence[Mapping[GroupKind, int]] | None = None) -> list[PipelineLayout] | None:
    """Deal the groups out to ``pipelines`` pipelines; each pipeline's stages follow ``ranked``.

    ``shares``: how many groups of each kind each pipeline gets (default: ``share_out``, as evenly as
    possible). Groups of a kind are taken in device order: ``contiguous`` keeps a pipeline's consecutive
    stages of one kind on a node, ``interleaved`` keeps the pipelines' stages at one position on a node.
    """
    counts = {k: len(v) for k, v in groups.items() if v}
    if shares is None:
        shares = share_out(counts, pipelines)
    if shares is None or len(shares) != pipelines:
        return None
    dealt = {k: deal(counts[k], [sh.get(k, 0) for sh in shares], placement) for k in counts}
    out = []
    for i in range(pipelines):
        chain: list[TPGroup] = []
        for kind in ranked:
            if kind in dealt:
                chain.extend(groups[kind][j] for j in dealt[kind][i])
        out.append(PipelineLayout(tuple(chain)))
    return out

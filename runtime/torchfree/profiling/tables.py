"""Measured tables a profile carries beside its fits: compute times on a grid of micro-batch size and
sequence length (per TP degree, in runtime/torchfree/profiling/profile.py ``MeasuredModel.tables``), and link
bandwidth by message size (``CommFigures.links`` / ``allreduce_curves``).

Fits smooth what they summarise; tables keep what was measured, so that a profile measured elsewhere
(Megatron, DeepSpeed, torch.profiler) is priced at its own points exactly. The rules, stated once here:

* compute, between grid points: piecewise linear in the micro-batch size and in the sequence length
  (bilinear on the grid), so every grid point is reproduced exactly;
* compute, outside the grid (or at a TP degree the table lacks): the value at the nearest grid point
  (each coordinate clamped into the grid; the nearest measured TP degree, the smaller on a tie), scaled
  by the component's reference fit (measured, else derived from the throughput figures) from that point
  to the one asked for — the fit's shape carries the table past its edge;
* links, by message size: time piecewise linear in bytes between measured sizes (exact at each size;
  between two sizes it is a latency + bytes / bandwidth line); below the smallest size the smallest
  size's time (latency bound), above the largest the largest size's bandwidth (bandwidth bound).

Imports no torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.torchfree.errors import Checker
from runtime.torchfree.spec.schema import MAX_FIGURE, MIN_FIGURE

Grid = tuple[tuple[float, ...], ...]


def _axis_problem(values: Sequence[int]) -> str | None:
    if len(values) < 1:
        return "must list at least one value"
    if any(v < 1 for v in values):
        return "values must be at least 1"
    if any(b <= a for a, b in zip(values, values[1:])):
        return "must be strictly increasing"
    return None


def _check_grid(c: Checker, name: str, grid: Grid, rows: int, cols: int) -> None:
    if len(grid) != rows:
        c.add(name, f"expected {rows} rows (one per micro-batch size), got {len(grid)}")
        return
    for i, row in enumerate(grid):
        if len(row) != cols:
            c.add(f"{name}[{i}]", f"expected {cols} values (one per sequence length), got {len(row)}")
        for j, v in enumerate(row):
            if not (math.isfinite(v) and v >= 0):
                c.add(f"{name}[{i}][{j}]", f"must be a non-negative number, got {v}")


def _bracket(axis: Sequence[int], x: float) -> tuple[int, int, float]:
    """(lower index, upper index, weight of the upper) of ``x`` on ``axis``, ``x`` inside its range."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        n = len(axis) - 1
        return n, n, 0.0
    hi = bisect.bisect_left(axis, x)
    if axis[hi] == x:
        return hi, hi, 0.0
    lo = hi - 1
    return lo, hi, (x - axis[lo]) / (axis[hi] - axis[lo])


@dataclass(frozen=True)
class ComponentTable:
    """Measured seconds of one instance of a component (on one TP shard) on a grid: ``forward_s[i][j]``
    at ``micro_batches[i]`` sequences of ``seq_lens[j]`` tokens. ``optimizer_s``: one AdamW step over the
    instance's parameters, when measured (independent of the micro-batch shape)."""

    micro_batches: tuple[int, ...]
    seq_lens: tuple[int, ...]
    forward_s: Grid
    backward_s: Grid
    optimizer_s: float | None = None

    def __post_init__(self) -> None:
        with Checker() as c:
            for name in ("micro_batches", "seq_lens"):
                why = _axis_problem(getattr(self, name))
                if why is not None:
                    c.add(name, why)
            if not c.problems:
                for name in ("forward_s", "backward_s"):
                    _check_grid(c, name, getattr(self, name), len(self.micro_batches), len(self.seq_lens))
            if self.optimizer_s is not None:
                c.check(math.isfinite(self.optimizer_s) and self.optimizer_s >= 0, "optimizer_s",
                        f"must be a non-negative number, got {self.optimizer_s}")

    def clamp(self, micro_batch: float, seq_len: float) -> tuple[float, float]:
        """The nearest point of the grid's range (each coordinate clamped)."""
        return (min(max(micro_batch, self.micro_batches[0]), self.micro_batches[-1]),
                min(max(seq_len, self.seq_lens[0]), self.seq_lens[-1]))

    def value(self, micro_batch: float, seq_len: float, backward: bool) -> float:
        """Seconds at a point inside the grid's range (bilinear; exact at grid points)."""
        grid = self.backward_s if backward else self.forward_s
        i0, i1, wi = _bracket(self.micro_batches, micro_batch)
        j0, j1, wj = _bracket(self.seq_lens, seq_len)
        low = grid[i0][j0] * (1 - wj) + grid[i0][j1] * wj
        high = grid[i1][j0] * (1 - wj) + grid[i1][j1] * wj
        return low * (1 - wi) + high * wi


def nearest_degree(degrees: Sequence[int], tp: int) -> int:
    """The measured TP degree nearest ``tp`` (the smaller on a tie)."""
    return min(degrees, key=lambda t: (abs(t - tp), t))


def curve_point_problem(nbytes: int, gbs: float, *, last: bool) -> str | None:
    """What is wrong with a link curve's point (a message of ``nbytes`` at ``gbs`` GB/s, latency included),
    None if fine: its message may take at most MAX_FIGURE seconds, as any time of a spec (1e-20 GB/s priced
    one message at 1e15 s); the largest message's rate also prices every larger one (``seconds``), so it is
    a rate and at least MIN_FIGURE GB/s like any other."""
    seconds = nbytes / (gbs * 1e9)
    if seconds > MAX_FIGURE:
        return (f"{gbs:g} GB/s takes {seconds:g} s for a {nbytes:,}-byte message: beyond any link (at most "
                f"{MAX_FIGURE:g} s a message)")
    if last and gbs < MIN_FIGURE:
        return (f"{gbs:g} GB/s at the largest message ({nbytes:,} bytes), the rate of every larger one, is below "
                f"any link (at least {MIN_FIGURE:g} GB/s there)")
    return None


@dataclass(frozen=True)
class LinkCurve:
    """Bandwidth by message size: ``bandwidth_gbs[i]`` is ``bytes[i] / seconds`` of a message of
    ``bytes[i]`` bytes (for an all-reduce: the bus bandwidth, ``2(n-1)/n x bytes / seconds``)."""

    bytes: tuple[int, ...]
    # Checked here, not by the spec reader's rate floor (MIN_FIGURE GB/s): a point is one message's effective
    # rate, latency included, and a tiny message is latency-bound: 1 byte in 10 ms (TCP on a loaded host) is
    # 1e-7 GB/s, a real measurement the floor refused.
    bandwidth_gbs: tuple[float, ...] = field(metadata={"rate_by_size": True})

    def __post_init__(self) -> None:
        with Checker() as c:
            why = _axis_problem(self.bytes)
            if why is not None:
                c.add("bytes", why)
            c.check(len(self.bandwidth_gbs) == len(self.bytes), "bandwidth_gbs",
                    f"expected {len(self.bytes)} values (one per message size), got {len(self.bandwidth_gbs)}")
            for i, bw in enumerate(self.bandwidth_gbs):
                if c.check(math.isfinite(bw) and bw > 0, f"bandwidth_gbs[{i}]", f"must be positive, got {bw}") \
                        and why is None and i < len(self.bytes):
                    problem = curve_point_problem(self.bytes[i], bw, last=i == len(self.bytes) - 1)
                    if problem is not None:
                        c.add(f"bandwidth_gbs[{i}]", problem)

    def seconds(self, nbytes: float) -> float:
        """Time of one message of ``nbytes`` (the rule in the module docstring); all-reduce curves give
        the time of ``nbytes x 2(n-1)/n`` bus bytes when given those."""
        times = [b / (bw * 1e9) for b, bw in zip(self.bytes, self.bandwidth_gbs)]
        if nbytes <= self.bytes[0]:
            return times[0]
        if nbytes >= self.bytes[-1]:
            return nbytes / (self.bandwidth_gbs[-1] * 1e9)
        lo, hi, w = _bracket(self.bytes, nbytes)
        return times[lo] * (1 - w) + times[hi] * w


@dataclass(frozen=True)
class LinkCurves:
    """One link class's curves for the profile's device: as the sender and as the receiver (a transfer
    takes the slower of its sender's and its receiver's curve); one of them may be absent."""

    send: LinkCurve | None = None
    recv: LinkCurve | None = None

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(self.send is not None or self.recv is not None, "", "give a send or a recv curve")

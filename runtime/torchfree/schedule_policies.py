"""What each pipeline schedule is and what it asks of a pipeline (torch-free, and cheap to import).

The names, the policies the list scheduler runs (``runtime.torchfree.list_scheduler``), the layouts of virtual
stages on devices, the documented activation bounds and the problems a plan's pipeline can have under a
schedule. They are apart from the scheduler because ``hspmd validate`` needs them and nothing else of it:
the scheduler's dozen op and message classes cost a start-up a tenth of its time to define (docs/design.md
§8), and a verb that only checks a plan has no use for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"]
SCHEDULE_NAMES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")
OpKind = Literal["F", "B", "W", "BW"]
Placement = Literal["loop", "v"]


# ---------------------------------------------------------------------------------------------------
# Layouts


@dataclass(frozen=True)
class Layout:
    """Which device and local chunk each virtual stage lives on."""

    num_devices: int
    chunks: int = 1
    placement: Placement = "loop"

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices: need at least one device, got {self.num_devices}")
        if self.chunks < 1:
            raise ValueError(f"chunks: need at least one chunk per device, got {self.chunks}")
        if self.placement not in ("loop", "v"):
            raise ValueError(f"placement: unknown placement {self.placement!r} (have: loop, v)")
        if self.placement == "v" and self.chunks != 2:
            raise ValueError(f"chunks: the V placement has exactly 2 chunks per device, got {self.chunks}")

    @property
    def num_stages(self) -> int:
        return self.num_devices * self.chunks

    def device(self, stage: int) -> int:
        s = self.num_devices
        if self.placement == "v":
            return stage if stage < s else 2 * s - 1 - stage
        return stage % s

    def chunk(self, stage: int) -> int:
        if self.placement == "v":
            return 0 if stage < self.num_devices else 1
        return stage // self.num_devices

    def stage(self, device: int, chunk: int) -> int:
        """The virtual stage held as ``chunk`` on ``device`` (inverse of ``device``/``chunk``)."""
        s = self.num_devices
        if self.placement == "v":
            return device if chunk == 0 else 2 * s - 1 - device
        return chunk * s + device


# ---------------------------------------------------------------------------------------------------
# Policies and the documented memory bound


@dataclass(frozen=True)
class Policy:
    """What distinguishes one schedule from another for the list scheduler.

    ``priority`` ranks op kinds (first wins among ready, allowed ops); ``alternate``: after a
    backward a ready forward goes first (1F1B's steady state); ``forwards_first`` keeps backwards
    waiting until the device has run every forward (GPipe's phases); ``order`` breaks ties between
    ops of one kind: ``"oldest"`` micro-batch first (then the later virtual stage: depth-first), or
    ``"groups"`` of ``S`` micro-batches through chunk 0, then chunk 1, ... (backwards from the last
    chunk down), Megatron's interleaved order; ``bound`` names the formula of
    ``live_activation_limit``; ``chunks``: the chunk count the schedule is defined for (None: chosen
    per pipeline)."""

    placement: Placement
    split_backward: bool
    priority: tuple[OpKind, ...]
    bound: Literal["depth", "all", "warmup", "v"]
    alternate: bool = True
    forwards_first: bool = False
    order: Literal["oldest", "groups"] = "oldest"
    chunks: int | None = 1


POLICIES: dict[str, Policy] = {
    "1f1b": Policy("loop", False, ("BW", "F"), "depth"),
    "gpipe": Policy("loop", False, ("F", "BW"), "all", alternate=False, forwards_first=True),
    "interleaved": Policy("loop", False, ("BW", "F"), "warmup", order="groups", chunks=None),
    "zb-h1": Policy("loop", True, ("B", "F", "W"), "depth"),
    # ZB-V rather than DualPipeV: DualPipeV's gain comes from running one micro-batch's forward and
    # another's backward as one fused op so that expert-parallel all-to-alls hide behind compute; our
    # dense models have no all-to-all to hide and the executor runs one op at a time. ZB-V needs only
    # the F / B / W ops every other schedule here uses, at 1F1B's peak memory.
    "zb-v": Policy("v", True, ("B", "F", "W"), "v", chunks=2),
}


def schedule_layout(name: str, num_devices: int, chunks: int | None = None) -> Layout:
    """The layout a schedule runs on (``chunks`` only matters for interleaved; default 2 there)."""
    pol = policy(name)
    v = pol.chunks if pol.chunks is not None else (2 if chunks is None else chunks)
    if chunks is not None and chunks != v:
        raise ValueError(f"chunks: {name} holds {v} chunk(s) per device, got {chunks}")
    return Layout(num_devices, v, pol.placement)


def live_activation_limit(name: str, num_devices: int, device: int, micro_batches: int,
                          chunks: int | None = None) -> int:
    """Most (micro-batch, chunk) activations ``device`` holds at once under schedule ``name``.

    * 1F1B, ZB-H1: ``min(S - s, m)`` for device ``s`` (ZB-H1 counts an activation until its W, so it
      needs no more memory than 1F1B: W is run early when the bound is reached).
    * GPipe: ``m`` (every forward before any backward).
    * interleaved (``v`` chunks; ``v = 1`` is 1F1B): ``min(v*m, 2*(S - s - 1) + (v - 1)*S + 1)``, one more than
      Megatron's warm-up forward count: micro-batch 0 passes device ``s`` ``v`` times before its
      first backward returns, and the warm-up covers the forwards the later devices run meanwhile.
    * ZB-V: ``min(2m, 2S)`` on every device: a full stage's activation is two chunks, so this is
      1F1B's first-stage peak (``S`` full micro-batches) on every device, memory balanced by the V.

    The scheduler enforces exactly this bound (tested on every shape and random uneven costs). With
    ``F = B = W`` on every chunk the peak reaches it (interleaved: when ``m`` is a multiple of ``S``);
    with uneven costs a device may stay below it (a backward arrives early).
    """
    if not 0 <= device < num_devices:
        raise ValueError(f"device {device} out of range for {num_devices} devices")
    s, m, d = num_devices, micro_batches, device
    bound = POLICIES[name].bound if name in POLICIES else None
    v = schedule_layout(name, num_devices, chunks).chunks
    if bound == "all":
        return m
    if bound == "depth" or (bound == "warmup" and v == 1):
        return min(s - d, m)
    if bound == "warmup":
        return min(v * m, 2 * (s - d - 1) + (v - 1) * s + 1)
    return min(2 * m, 2 * s)


def device_limits(name: str, num_devices: int, micro_batches: int, chunks: int | None = None,
                  limits: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per device the activation bound the list scheduler enforces: ``live_activation_limit``, or where
    ``limits`` raises it (a plan's ``activation_limits``: a device with memory to spare may run more
    forwards ahead, which under a split backward lets it defer more W into the fill and drain), that,
    capped at the ``v*m`` activations a step has. ``limit_problems`` says which ``limits`` are valid."""
    own = [live_activation_limit(name, num_devices, d, micro_batches, chunks) for d in range(num_devices)]
    if limits is None:
        return tuple(own)
    v = schedule_layout(name, num_devices, chunks).chunks
    return tuple(min(v * micro_batches, max(a, int(b))) for a, b in zip(own, limits))


def limit_problems(name: str, num_devices: int, micro_batches: int, chunks: int | None,
                   limits: Sequence[int]) -> list[str]:
    """Why ``limits`` cannot be a pipeline's activation bounds, one ``FIELD: what is wrong`` line each: one
    per device, integers, none below the schedule's own bound (``live_activation_limit``: the list
    scheduler is only shown deadlock-free from there up)."""
    if len(limits) != num_devices:
        return [f"activation_limits: lists {len(limits)} limit(s) for {num_devices} stage(s)"]
    bad = [x for x in limits if isinstance(x, bool) or not isinstance(x, int)]
    if bad:
        return [f"activation_limits: limits must be integers, got {bad}"]
    own = [live_activation_limit(name, num_devices, d, micro_batches, chunks) for d in range(num_devices)]
    return [f"activation_limits[{d}]: {x} is below {name}'s own bound of {own[d]} activations for this stage"
            for d, x in enumerate(limits) if x < own[d]]


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"schedule: unknown schedule {name!r} (have: {', '.join(SCHEDULE_NAMES)})") from None


# ---------------------------------------------------------------------------------------------------
# Validation (problems as data; the plan validator prefixes its own path)


def schedule_problems(name: str, num_devices: int, micro_batches: int, chunks: int | None = None) -> list[str]:
    """Why ``name`` cannot run a pipeline of ``num_devices`` devices and ``micro_batches`` micro-batches
    with ``chunks`` chunks per device, one ``FIELD: what is wrong`` line each (empty: it can)."""
    if name not in POLICIES:
        return [f"schedule: unknown schedule {name!r} (have: {', '.join(SCHEDULE_NAMES)})"]
    out = []
    pol = POLICIES[name]
    if num_devices < 1:
        out.append(f"stages: a pipeline needs at least one stage, got {num_devices}")
    if micro_batches < 1:
        out.append(f"micro_batches: need at least one micro-batch, got {micro_batches}")
    if chunks is not None:
        if pol.chunks is not None and chunks != pol.chunks:
            out.append(f"chunks: {name} holds {pol.chunks} chunk(s) per device, got {chunks}")
        elif chunks < 1:
            out.append(f"chunks: need at least one chunk per device, got {chunks}")
    if pol.order == "groups" and 1 <= micro_batches < num_devices:
        # Megatron's interleaved order is defined on whole groups of S micro-batches, and so are the
        # documented bound's and step time's claims. (The list scheduler itself runs m < S without
        # stalling, faster than 1F1B: lift this line if the planner wants those shapes.)
        out.append(f"micro_batches: interleaved needs at least one micro-batch per stage "
                   f"({num_devices}), got {micro_batches}")
    return out


def chunk_problems(chunk_layers: Sequence[Sequence[tuple[int, int]]], num_layers: int,
                   placement: Placement = "loop", model: str = "the model") -> list[str]:
    """Layer ranges ``[start, stop)`` per device per chunk that do not form the pipeline.

    The virtual stages, in ``placement``'s order, must tile ``[0, num_layers)``: each starts where the
    previous one stops. Checks, one line each: devices with differing chunk counts, empty ranges,
    ranges past the model's end, overlaps, layers left uncovered. One-chunk stages are named
    ``stages[d].layers`` (their YAML form is a single pair), several chunks ``stages[d].layers[c]``."""
    if not chunk_layers:
        return ["stages: no stages"]
    counts = [len(c) for c in chunk_layers]
    empty = [f"stages[{d}].layers: no layer range" for d, n in enumerate(counts) if n == 0]
    if empty:
        return empty
    if len(set(counts)) != 1:
        return [f"stages: every stage needs the same number of chunks, got {counts}"]
    try:
        layout = Layout(len(chunk_layers), counts[0], placement)
    except ValueError as e:
        return [f"stages: {e}"]
    single = layout.chunks == 1

    def where(j: int) -> str:
        d, c = layout.device(j), layout.chunk(j)
        return f"stages[{d}].layers" if single else f"stages[{d}].layers[{c}]"

    def name(j: int) -> str:
        return f"stage {j}" if single else f"virtual stage {j} ({where(j)}, {placement} placement)"

    out: list[str] = []
    covered = 0
    last = -1
    for j in range(layout.num_stages):
        a, b = chunk_layers[layout.device(j)][layout.chunk(j)]
        if not 0 <= a < b:
            out.append(f"{where(j)}: must be a non-empty range [start, end), got [{a}, {b}]")
            continue
        if b > num_layers:
            out.append(f"{where(j)}: range [{a}, {b}) goes past {model}'s {num_layers} layers")
        if last >= 0 and a < covered:
            pa = chunk_layers[layout.device(last)][layout.chunk(last)][0]
            whose = name(last) if a >= pa else "the virtual stages before it"
            out.append(f"{where(j)}: overlaps layers [{a}, {min(b, covered)}) of {whose}")
        elif a > covered:
            what = (f"{name(last)} ends at {covered}" if last >= 0 else
                    f"the first {'stage' if single else 'virtual stage'} must start at 0")
            out.append(f"{where(j)}: leaves layers [{covered}, {a}) uncovered ({what})")
        covered = max(covered, b)
        last = j
    if 0 <= last and covered < num_layers:
        out.append(f"{where(last)}: pipeline ends at layer {covered}, leaving layers [{covered}, {num_layers}) "
                   f"of {model} uncovered")
    return out

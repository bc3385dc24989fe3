"""The device profile format: what one accelerator kind costs, measured or from its datasheet.

One YAML file per device type (format in profiles/README.md). A profile has two layers:

* model-independent figures (``compute``, ``comm``, ``memory``, ``optimizer``): achievable FLOPS,
  memory bandwidth, per-op overhead, link latency. Spec profiles have only these, derived from
  datasheet figures times an achievable-efficiency factor; the cost model turns them into per-component
  costs for any model.
* ``models``: per measured model shape, per TP degree, per component (embedding, attention, mlp, norm,
  head) fits of forward time, backward time and saved-activation bytes. For a micro-batch of ``B``
  sequences of length ``s`` a fit ``[a, b, c]`` means ``a*B*s^2 + b*B*s + c``: the quadratic term is
  per sequence (attention), the linear one per token, the constant per call (dispatch overhead).
  Optionally (``blocks``, measured profiles since this field exists) the same fits for whole stage
  blocks timed through the runtime's stage module: one decoder layer, a stage's fixed time per
  micro-batch, and what the embedding and the head add; the cost model prefers them for time.

Pricing (``component_fits``, ``block_seconds``) and the loading rule (``resolve_profiles``: measured beats
imported beats spec) are here too. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runtime.torchfree.errors import Checker, Problem, SpecError
from runtime.torchfree.profiling.tables import ComponentTable, LinkCurve, LinkCurves, nearest_degree
from runtime.torchfree.spec.catalog import PROFILES_DIR
from runtime.torchfree.spec.cluster import DeviceType
from runtime.torchfree.spec.io import atomic_write_text, check_version, dump_yaml, is_dir, is_file, read_json, read_yaml
from runtime.torchfree.spec.model import Architecture, ModelSpec
from runtime.torchfree.spec.schema import build, to_data

PROFILE_VERSION = 1
COMPONENTS = ("embedding", "attention", "mlp", "norm", "head")
# Stage blocks (per micro-batch, as the engine runs a stage): one decoder layer, a stage's fixed time,
# and what being the first (embedding) and the last stage (final norm, head, loss) add.
BLOCKS = ("layer", "stage", "embedding", "head")
# The blocks of a backward split in two (zero-bubble schedules): the embedding's chunk is never split (it has
# no input gradient: its W is its whole backward), so only these.
SPLIT_BLOCKS = ("layer", "stage", "head")
# measured: by ``hspmd profile`` here; imported: measured elsewhere (``hspmd profile import``); spec: datasheet.
Provenance = Literal["measured", "imported", "spec"]
# Which links a link curve describes: between two devices of one node, or across nodes.
LinkClass = Literal["intra", "inter"]
# The components a per-layer-index override may replace (one decoder layer's).
LAYER_COMPONENTS = ("attention", "mlp", "norm")
Fit = tuple[float, float, float]


def eval_fit(fit: Fit, micro_batch: float, seq_len: float) -> float:
    """``a*B*s^2 + b*B*s + c`` for B sequences of length s."""
    a, b, c = fit
    return (a * seq_len + b) * seq_len * micro_batch + c



def check_keys(c: Checker, path: str, got: Mapping[str, Any], expected: Sequence[str], what: str, *,
               complete: bool = True) -> None:
    """One problem for the entries ``expected`` names that ``got`` lacks (when it must be ``complete``), one
    per entry it does not name."""
    missing = [k for k in expected if k not in got] if complete else []
    if missing:
        c.add(path, f"missing {what}(s) {', '.join(missing)}")
    c.problems += [(f"{path}.{k}", f"unknown {what} (expected one of: {', '.join(expected)})") for k in got
                   if k not in expected]

@dataclass(frozen=True)
class ComponentFit:
    """One component (one instance of it, on one TP shard) at one TP degree."""

    forward_s: Fit
    backward_s: Fit
    activation_bytes: Fit   # tensors saved for backward, per micro-batch
    params: int             # local parameters of one instance (per shard)
    residual: float = 0.0   # largest relative error of the time fits over the measured points

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("params", "residual"), lambda v: v >= 0, "must not be negative")


@dataclass(frozen=True)
class MeasuredModel:
    """Component fits for one model shape (matched on these sizes, never on the model's name)."""

    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    micro_batch: int
    seq_lens: tuple[int, ...]
    tp: Mapping[int, Mapping[str, ComponentFit]]
    # Per TP degree > 1: what the runtime's TP layer (DTensor dispatch and its collectives) adds to one
    # decoder layer over the plain local shard, measured among local processes. Absent: the cost model
    # counts the collectives from the link figures instead.
    tp_overhead: Mapping[int, ComponentFit] = field(default_factory=dict)
    # Per TP degree > 1, per stage block (``BLOCKS``): what the runtime's TP stage modules add over the
    # plain local shards (wall time; its ``layer`` is ``tp_overhead``). Absent in older profiles.
    tp_blocks: Mapping[int, Mapping[str, ComponentFit]] = field(default_factory=dict)
    # The same with sequence parallelism on (``training.sequence_parallel``: the TP stage modules shard the
    # residual stream along the sequence, reduce-scatter + all-gather instead of all-reduce); the cost model
    # prices a sequence-parallel plan's TP stages by them. Absent in older profiles (the cost model then
    # uses ``tp_blocks`` for those plans too: the same bytes cross the links).
    tp_blocks_sp: Mapping[int, Mapping[str, ComponentFit]] = field(default_factory=dict)
    # Per TP degree: whole stage blocks (``BLOCKS``) timed through the runtime's stage module; absent in
    # older profiles, where the cost model sums the components instead.
    blocks: Mapping[int, Mapping[str, ComponentFit]] = field(default_factory=dict)
    # Per TP degree: the ``SPLIT_BLOCKS``' backward as a split-backward schedule runs it, B (input
    # gradients) then W (weight gradients) as two autograd passes: ``forward_s`` fits B, ``backward_s`` W.
    # On a CPU the two passes cost well more than the fused backward (each pays the autograd engine's
    # per-node overhead), so the halves are measured, not shared out. Absent in older profiles, where the
    # cost model splits the fused backward by FLOPs.
    split_blocks: Mapping[int, Mapping[str, ComponentFit]] = field(default_factory=dict)
    # Per TP degree, per component: measured seconds on a grid of micro-batch size and sequence length
    # (runtime/torchfree/profiling/tables.py: interpolation and extrapolation rules); they override the time fits.
    tables: Mapping[int, Mapping[str, ComponentTable]] = field(default_factory=dict)
    # Per decoder-layer index, per TP degree, per component (attention, mlp, norm): a layer that costs
    # other than the rest (the first one, say) replaces those components' times by its own table.
    layers: Mapping[int, Mapping[int, Mapping[str, ComponentTable]]] = field(default_factory=dict)
    # The measured TP degrees' times already include their collectives (a TP layer timed whole, as
    # Megatron's and DeepSpeed's profilers time it): the cost model adds no TP overhead at those degrees.
    includes_tp_comm: bool = False
    # The decoder's layout (``ModelSpec.architecture``): a GPT-style model of a Llama's sizes is another model.
    architecture: Architecture = "llama"

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(len(self.seq_lens) >= 1, "seq_lens", "must list the measured sequence lengths")
            for t, comps in self.tables.items():
                c.check(t >= 1, f"tables.{t}", "TP degree must be at least 1")
                check_keys(c, f"tables.{t}", comps, COMPONENTS, "component", complete=False)
            for i, by_tp in self.layers.items():
                c.check(i >= 0, f"layers.{i}", "layer index must not be negative")
                for t, comps in by_tp.items():
                    c.check(t >= 1, f"layers.{i}.{t}", "TP degree must be at least 1")
                    check_keys(c, f"layers.{i}.{t}", comps, LAYER_COMPONENTS, "layer component", complete=False)
            for name in ("blocks", "tp_blocks", "tp_blocks_sp"):
                for t, blocks in getattr(self, name).items():
                    check_keys(c, f"{name}.{t}", blocks, BLOCKS, "block")
            for t, blocks in self.split_blocks.items():
                check_keys(c, f"split_blocks.{t}", blocks, SPLIT_BLOCKS, "block")
            c.check(len(self.tp) >= 1 or len(self.tables) >= 1, "tp",
                    "must hold at least one TP degree (or give tables)")
            for t, comps in self.tp.items():
                c.check(t >= 1, f"tp.{t}", "TP degree must be at least 1")
                check_keys(c, f"tp.{t}", comps, COMPONENTS, "component")

    def matches(self, model: ModelSpec) -> bool:
        return (self.hidden_size, self.ffn_hidden_size, self.num_heads, self.num_kv_heads, self.vocab_size,
                self.architecture) == (model.hidden_size, model.ffn_hidden_size, model.num_heads, model.num_kv_heads,
                                       model.vocab_size, model.architecture)


@dataclass(frozen=True)
class ComputeFigures:
    """What the device's kernels achieve, independent of the model."""

    peak_tflops: float          # dense bf16 (fp16 where there is no bf16); CPUs: measured GEMM rate
    matmul_efficiency: float    # fraction of peak large training GEMMs reach
    attention_efficiency: float  # fraction of peak the attention kernel (s^2 part) reaches
    memory_bandwidth_gbs: float
    memory_efficiency: float    # fraction of memory bandwidth elementwise kernels reach
    kernel_overhead_s: float    # fixed cost per kernel / op dispatch
    flash_attention: bool       # fused attention: no s^2 score matrix kept for backward
    activation_bytes: int = 2   # bytes per activation element (2: bf16 autocast; 4: fp32)

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("peak_tflops", "memory_bandwidth_gbs"), lambda v: v > 0, "must be positive")
            c.each(self, ("matmul_efficiency", "attention_efficiency", "memory_efficiency"), lambda v: 0 < v <= 1,
                   "must be in (0, 1]")
            c.each(self, ("kernel_overhead_s",), lambda v: v >= 0, "must not be negative")
            c.check(self.activation_bytes in (1, 2, 4), "activation_bytes", "must be 1, 2 or 4")


@dataclass(frozen=True)
class LinkFit:
    """``time = latency_s + bytes / (bandwidth_gbs * 1e9)``; for all-reduce, bytes = 2(n-1)/n x size."""

    latency_s: float
    bandwidth_gbs: float

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("latency_s",), lambda v: v >= 0, "must not be negative")
            c.each(self, ("bandwidth_gbs",), lambda v: v > 0, "must be positive")


@dataclass(frozen=True)
class CommFigures:
    p2p_latency_s: float
    allreduce_latency_s: float    # per ring step
    bandwidth_efficiency: float   # fraction of the cluster's link bandwidth collectives reach
    p2p: LinkFit | None = None    # measured between two local devices of this type
    allreduce: Mapping[int, LinkFit] = field(default_factory=dict)  # measured, by group size
    # Measured, by group size: an all-gather of B gathered bytes takes latency + (n-1)/n x B / bandwidth
    # (absent: half an all-reduce, as a ring all-gather would be).
    allgather: Mapping[int, LinkFit] = field(default_factory=dict)
    # Measured elsewhere (``hspmd profile import``): bandwidth by message size and direction, per link
    # class; they replace ``p2p`` and the cluster's bandwidth for transfers of that class.
    links: Mapping[LinkClass, LinkCurves] = field(default_factory=dict)
    # The same for all-reduces, per link class and group size (bus bandwidth by message size); across
    # nodes they are the only measured all-reduce rates (``allreduce`` is measured among one node's).
    allreduce_curves: Mapping[LinkClass, Mapping[int, LinkCurve]] = field(default_factory=dict)
    # A device's send and receive posted at one schedule tick serialise on its links (half duplex, or
    # one connection per peer pair carrying both directions in turn); False: they overlap.
    serialised_send_recv: bool = False

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("p2p_latency_s", "allreduce_latency_s"), lambda v: v >= 0, "must not be negative")
            c.each(self, ("bandwidth_efficiency",), lambda v: 0 < v <= 1, "must be in (0, 1]")
            sizes = [("allreduce", self.allreduce), ("allgather", self.allgather)]
            sizes += [(f"allreduce_curves.{cls}", curves) for cls, curves in self.allreduce_curves.items()]
            for where, by_n in sizes:
                for n in by_n:
                    c.check(n >= 2, f"{where}.{n}", "group size must be at least 2")


@dataclass(frozen=True)
class MemoryFigures:
    """Bytes per parameter of each kind of state, and what the framework itself takes."""

    param_bytes: float = 4.0        # fp32 weights (bf16 autocast keeps fp32 parameters)
    grad_bytes: float = 4.0
    optimizer_bytes: float = 8.0    # AdamW first and second moments; divided by the ZeRO degree
    framework_overhead_gib: float = 1.0
    # Under bf16 autocast, the bf16 copy of every matrix weight a step's forwards share (runtime/engine/
    # reference.py ``step_casts``): 2; fp32 compute: 0.
    cast_bytes: float = 0.0

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("param_bytes", "grad_bytes", "optimizer_bytes", "framework_overhead_gib", "cast_bytes"),
                   lambda v: v >= 0, "must not be negative")


@dataclass(frozen=True)
class OptimizerFit:
    """AdamW step time: ``seconds_per_param * params + seconds_per_tensor * tensors + fixed_s``."""

    seconds_per_param: float
    fixed_s: float = 0.0
    seconds_per_tensor: float = 0.0

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("seconds_per_param", "fixed_s", "seconds_per_tensor"), lambda v: v >= 0,
                   "must not be negative")


@dataclass(frozen=True)
class Source:
    """Where the figures come from."""

    note: str = ""
    host: str | None = None
    torch_version: str | None = None
    date: str | None = None
    derived_from: str | None = None  # e.g. the measured CPU an emulated type was scaled from
    slowdown: float = 1.0


@dataclass(frozen=True)
class DeviceProfile:
    version: int
    device_type: str
    provenance: Provenance
    memory_gib: float
    compute: ComputeFigures
    comm: CommFigures
    memory: MemoryFigures
    optimizer: OptimizerFit
    source: Source = field(default_factory=Source)
    models: Mapping[str, MeasuredModel] = field(default_factory=dict)
    # A step's own code outside its compute and comm spans (gradients collected and reset, the global
    # norm summed tensor by tensor): never stretched on emulated devices. Measured profiles only.
    step_overhead: OptimizerFit = field(default_factory=lambda: OptimizerFit(0.0))
    # The gradient sync's local work around each bucket's all-reduce (slices packed into the bucket and
    # copied back), on top of the all-reduce itself. Measured profiles only.
    sync_pack: OptimizerFit = field(default_factory=lambda: OptimizerFit(0.0))
    # A fixed cost per training iteration beyond its compute, communication and optimizer (launches,
    # synchronisation, logging), when measured: added once to every step.
    iteration_s: float = 0.0

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(math.isfinite(self.iteration_s) and self.iteration_s >= 0, "iteration_s",
                    f"must be a non-negative number of seconds, got {self.iteration_s}")
            c.check(self.version == PROFILE_VERSION, "version",
                    f"unsupported profile version {self.version} (this hspmd reads version {PROFILE_VERSION})")
            c.check(bool(self.device_type), "device_type", "must not be empty")
            c.each(self, ("memory_gib",), lambda v: v > 0, "must be positive")

    def measured_model(self, model: ModelSpec) -> MeasuredModel | None:
        """The measured fits for this model's shape, if any (first match in file order)."""
        for m in self.models.values():
            if m.matches(model):
                return m
        return None


# Figures older profiles carry about the CPU host that emulated devices in tests (cores shared, caches gone
# cold after idling, the executor's CPU per message): no price reads them; they load, ignored, with a note.
LEGACY_HOST_FIELDS = {
    ("compute",): ("host_cores",),
    ("comm",): ("p2p_wake", "p2p_actions", "shared_core_p2p_s"),
    ("models", "*"): ("resume", "core_sharing", "core_sharing_curve", "core_handoff", "tp_blocks_cpu",
                      "tp_blocks_sp_cpu"),
}


def load_profile(path: str | Path) -> DeviceProfile:
    """Parse one profile file; any problem is a SpecError naming the file and the field. The host figures of
    older profiles (``LEGACY_HOST_FIELDS``) are dropped, with a one-line note on stderr."""
    file = str(path)
    data = (read_json if Path(path).suffix.lower() == ".json" else read_yaml)(path)
    if data is None:
        raise SpecError([Problem(file, "", "is empty, expected a mapping")])
    check_version(data, PROFILE_VERSION, file)
    dropped = drop_legacy_host_fields(data)
    if dropped:
        print(f"note: {file}: ignoring the CPU-host figures {', '.join(dropped)} (hspmd no longer models the "
              "host; re-profile to drop them)", file=sys.stderr)
    return build(DeviceProfile, data, file)


def drop_legacy_host_fields(data: Any) -> list[str]:
    """Remove ``LEGACY_HOST_FIELDS`` from a profile's raw mapping in place; their field paths, sorted."""
    dropped: list[str] = []
    if not isinstance(data, dict):
        return dropped
    for where, names in LEGACY_HOST_FIELDS.items():
        parents: list[tuple[str, Any]] = [("", data)]
        for key in where:
            parents = [(f"{p}{k}.", v) for p, m in parents if isinstance(m, dict)
                       for k, v in (m.items() if key == "*" else [(key, m.get(key))])]
        for prefix, m in parents:
            for n in names:
                if isinstance(m, dict) and n in m:
                    del m[n]
                    dropped.append(f"{prefix}{n}")
    return sorted(dropped)


def dump_profile(profile: DeviceProfile) -> str:
    return dump_yaml(to_data(profile))


def save_profile(profile: DeviceProfile, path: str | Path) -> None:
    atomic_write_text(path, dump_profile(profile))


def read_profile_dir(directory: str | Path) -> list[tuple[Path, DeviceProfile]]:
    """Every ``*.yaml`` profile in a directory (not recursive), sorted by file name."""
    d = Path(directory)
    if not is_dir(d):
        what = "is a file, expected a directory of profiles" if is_file(d) else "profile directory not found"
        raise SpecError([Problem(str(d), "", what)])
    out: list[tuple[Path, DeviceProfile]] = []
    problems: list[Problem] = []
    for p in sorted(d.glob("*.yaml")):
        try:
            out.append((p, load_profile(p)))
        except SpecError as err:
            problems.extend(err.problems)
    if problems:
        raise SpecError(problems)
    return out


# ---------------------------------------------------------------------------------------------------
# Pricing compute blocks from a profile. The cost model (planner/cost.py) builds on these; a sleep-mode
# device's target (planner/costmodel/targets.py) prices its blocks with ``block_seconds``.


def analytic_components(model: ModelSpec, c: ComputeFigures, tp: int) -> dict[str, ComponentFit]:
    """Per-component fits (time: ``a*B*s^2 + b*B*s + c``; saved activation bytes likewise) from FLOPs
    and bytes moved. Counts follow runtime/models/llama.py: separate q/k/v/o projections, unfused RoPE,
    SDPA attention (fused: causal, no s^2 kept; unfused: full s^2 scores kept), SwiGLU, fp32 RMSNorm. A
    GPT-style decoder (``model.gpt``): no RoPE (learned positions, or GPT-NeoX's rotary counted alike),
    a 2-matrix GELU MLP, LayerNorms, biases (a row-parallel projection's bias whole on every shard, as
    runtime/torchfree/models/decoders.py lays them out), and the position table with the embedding."""
    h, f, kv, n, v, t = (model.hidden_size, model.ffn_hidden_size, model.kv_dim, model.num_heads,
                         model.vocab_size, tp)
    mm = c.peak_tflops * 1e12 * c.matmul_efficiency
    at = c.peak_tflops * 1e12 * c.attention_efficiency
    bw = c.memory_bandwidth_gbs * 1e9 * c.memory_efficiency
    k, e = c.kernel_overhead_s, c.activation_bytes

    # Attention: projections (per token), scores and weighted sum (per s^2), RoPE and reshapes (bytes).
    gpt = model.gpt
    proj = (2 * h * (h + 2 * kv) + 2 * h * h) / t
    rope_bytes = 8 * (h + kv) / t * e if model.rotary else 0.0
    if c.flash_attention:
        a_fwd = 2 * h / t / at                       # causal half of 4*s^2*h FLOPs
        a_bwd = 2.5 * a_fwd                          # backward recomputes the scores
        a_act = 0.0
    else:
        softmax_bytes = 6 * n / t * e                # scale, mask, softmax passes over s^2 scores
        a_fwd = 4 * h / t / at + softmax_bytes / bw
        a_bwd = 2 * a_fwd
        a_act = 2 * n / t * e                        # scores and probabilities
    attn_act = e * (h + 2 * (h + kv) / t + 2 * (h + kv) / t + h / t) + 4 * n / t
    attention = ComponentFit(
        forward_s=(a_fwd, proj / mm + rope_bytes / bw, 14 * k),
        backward_s=(a_bwd, 2 * proj / mm + 2 * rope_bytes / bw, 28 * k),
        activation_bytes=(a_act, attn_act, 0.0),
        params=(model.attention_params() - h) // t + h if gpt else (2 * h * h + 2 * kv * h) // t)
    matrices = 2 if gpt else 3   # GPT: up and down; SwiGLU: gate, up and down
    mlp_flops = 2 * matrices * h * f / t
    mlp_bytes = (3 if gpt else 5) * f / t * e
    mlp = ComponentFit(
        forward_s=(0.0, mlp_flops / mm + mlp_bytes / bw, 5 * k),
        backward_s=(0.0, 2 * mlp_flops / mm + 2 * mlp_bytes / bw, 10 * k),
        activation_bytes=(0.0, e * (h + (2 if gpt else 4) * f / t), 0.0),
        params=(2 * h * f + f) // t + h if gpt else 3 * h * f // t)
    norm_bytes = h * (2 * e + 8)
    norm = ComponentFit(
        forward_s=(0.0, norm_bytes / bw, 6 * k), backward_s=(0.0, 2 * norm_bytes / bw, 12 * k),
        activation_bytes=(0.0, e * h + (8.0 if gpt else 4.0), 0.0), params=model.norm_params)
    positions = model.position_rows * h   # a learned position table: duplicated on every TP shard
    embedding = ComponentFit(
        forward_s=(0.0, (2 * h * e + (h * e if positions else 0)) / bw, 3 * k),
        backward_s=(0.0, 8 * h / bw, 4 * k + 4 * (v * h / t + positions) / bw),
        activation_bytes=(0.0, 8.0, 0.0), params=v * h // t + positions)
    head_flops = 2 * h * v / t
    ce_bytes = 12 * v / t
    head = ComponentFit(
        forward_s=(0.0, head_flops / mm + ce_bytes / bw, 8 * k),
        backward_s=(0.0, 2 * head_flops / mm + ce_bytes / bw, 10 * k),
        activation_bytes=(0.0, e * h + 8 * v / t, 0.0), params=v * h // t)
    return {"embedding": embedding, "attention": attention, "mlp": mlp, "norm": norm, "head": head}


def reference_fits(profile: DeviceProfile, model: ModelSpec, tp: int) -> dict[str, ComponentFit]:
    """Per-component fits of ``model`` on this profile at this TP degree: measured if the profile has this
    model shape and TP degree, else derived from its throughput figures (``analytic_components``)."""
    measured = profile.measured_model(model)
    if measured is not None and tp in measured.tp:
        return dict(measured.tp[tp])
    return analytic_components(model, profile.compute, tp)


def component_fits(profile: DeviceProfile, model: ModelSpec, tp: int, micro_batch: int | None = None,
                   seq_len: int | None = None) -> dict[str, ComponentFit]:
    """``reference_fits``, with the times of the components the profile has tables for resolved at
    ``micro_batch`` x ``seq_len`` (then constant fits: valid at that shape only). Which one prices a
    component: a table at this TP degree, else a measured fit at it, else a table at the nearest TP
    degree (scaled by the reference fits, runtime/torchfree/profiling/tables.py), else the derived fit."""
    ref = reference_fits(profile, model, tp)
    measured = profile.measured_model(model)
    if measured is None or not measured.tables or micro_batch is None or seq_len is None:
        return ref
    out = dict(ref)
    for name in COMPONENTS:
        by_tp = {t: comps[name] for t, comps in measured.tables.items() if name in comps}
        if by_tp and (tp in by_tp or tp not in measured.tp):
            out[name] = _tabled(ref[name], by_tp, lambda t, k=name: reference_fits(profile, model, t)[k],
                                tp, micro_batch, seq_len)
    return out


def _tabled(fit: ComponentFit, by_tp: Mapping[int, ComponentTable], ref: Callable[[int], ComponentFit], tp: int,
            micro_batch: int, seq_len: int) -> ComponentFit:
    """``fit`` with its times read from the tables (constant fits at this shape)."""
    t0 = tp if tp in by_tp else nearest_degree(sorted(by_tp), tp)
    table = by_tp[t0]
    b0, s0 = table.clamp(micro_batch, seq_len)
    exact = (t0, b0, s0) == (tp, micro_batch, seq_len)
    here, there = (fit, ref(t0)) if not exact else (fit, fit)

    def seconds(backward: bool) -> float:
        v = table.value(b0, s0, backward)
        if exact:
            return v
        num = eval_fit(here.backward_s if backward else here.forward_s, micro_batch, seq_len)
        den = eval_fit(there.backward_s if backward else there.forward_s, b0, s0)
        return v * num / den if den > 0 else v

    return dataclasses.replace(fit, forward_s=(0.0, 0.0, seconds(False)), backward_s=(0.0, 0.0, seconds(True)))


def layer_override_fits(profile: DeviceProfile, model: ModelSpec, tp: int, layer: int, micro_batch: int,
                        seq_len: int) -> dict[str, ComponentFit] | None:
    """The components of decoder layer ``layer`` where the profile overrides that layer (``MeasuredModel
    .layers``), resolved at this shape as ``component_fits`` resolves tables; None where it does not."""
    measured = profile.measured_model(model)
    if measured is None or layer not in measured.layers:
        return None
    out = component_fits(profile, model, tp, micro_batch, seq_len)
    for name in LAYER_COMPONENTS:
        by_tp = {t: comps[name] for t, comps in measured.layers[layer].items() if name in comps}
        if by_tp:
            out[name] = _tabled(reference_fits(profile, model, tp)[name], by_tp,
                                lambda t, k=name: reference_fits(profile, model, t)[k], tp, micro_batch, seq_len)
    return out


def measured_tp_comm(profile: DeviceProfile, model: ModelSpec, tp: int) -> bool:
    """The profile's times at this TP degree include the TP collectives (``includes_tp_comm``, at a
    measured degree: a table's or a fit's, not one scaled from another degree)."""
    m = profile.measured_model(model)
    return m is not None and m.includes_tp_comm and (tp in m.tables or tp in m.tp)


def table_optimizer_s(profile: DeviceProfile, model: ModelSpec, tp: int, num_layers: int, first: bool,
                      last: bool) -> float | None:
    """One AdamW step of a stage from measured per-component optimizer seconds (tables at this TP
    degree), summed as the stage holds the components; None unless every one of them was measured."""
    m = profile.measured_model(model)
    comps = None if m is None else m.tables.get(tp)
    if comps is None or any(comps.get(k) is None or comps[k].optimizer_s is None for k in COMPONENTS):
        return None
    secs = {k: comps[k].optimizer_s for k in COMPONENTS}
    layer = sum(secs[k] for k in ("attention", "mlp", "norm", "norm"))
    extra = (secs["embedding"] if first else 0.0) + ((secs["norm"] + secs["head"]) if last else 0.0)
    return num_layers * layer + extra  # type: ignore[operator]


def layer_components(comps: Mapping[str, ComponentFit]) -> tuple[ComponentFit, ...]:
    """One decoder layer as the runtime's model builds it: attention, MLP and two RMSNorms."""
    return (comps["attention"], comps["mlp"], comps["norm"], comps["norm"])


def extra_components(comps: Mapping[str, ComponentFit], first: bool, last: bool) -> tuple[ComponentFit, ...]:
    """What a stage runs besides its layers: the first stage's embedding, the last one's final norm and
    head (with the loss)."""
    return ((comps["embedding"],) if first else ()) + ((comps["norm"], comps["head"]) if last else ())


@dataclass(frozen=True)
class ComputeBlock:
    """One compute block as the engine runs it: a micro-batch's forward or backward through one stage (of
    ``layers`` decoder layers, on one device of a TP group of ``tp``; ``first``: with the embedding;
    ``last``: with the final norm, head and loss; ``recompute``: whole-layer checkpoints)."""

    layers: int
    micro_batch: int
    seq_len: int
    backward: bool
    tp: int = 1
    recompute: bool = False
    first: bool = False
    last: bool = False
    documents: tuple[int, ...] = ()  # packed: the lengths of the documents sharing its one row

    def __post_init__(self) -> None:
        with Checker() as c:
            c.each(self, ("layers",), lambda v: v >= 0, "must not be negative")
            c.each(self, ("micro_batch", "seq_len", "tp"), lambda v: v >= 1, "must be at least 1")
            c.check(self.layers > 0 or self.first or self.last, "layers", "an empty stage computes nothing")


def block_seconds(profile: DeviceProfile, model: ModelSpec, block: ComputeBlock) -> float:
    """What ``profile`` prices one compute block of ``model``'s shapes at: its component fits
    (``component_fits``) summed as the stage runs them; a recomputing stage's backward re-runs its layers'
    forward first. Compute only: the TP collectives are not in it (on the targets this prices, NVLink-class
    TP all-reduces are a few percent of a layer; the emulated device's own TP collectives run inside its
    block and count against the target)."""
    if block.documents:
        # Packed documents share one row: each document's attention is its own (the fits' s^2 term), the
        # per-token work adds up, and the block's fixed cost (the fits' constant) is paid once.
        one = [dataclasses.replace(block, micro_batch=1, seq_len=n, documents=()) for n in block.documents]
        fixed = _block_seconds(profile, model, one[0], at_seq=0)
        return sum(_block_seconds(profile, model, d) for d in one) - (len(one) - 1) * fixed
    return _block_seconds(profile, model, block)


def _block_seconds(profile: DeviceProfile, model: ModelSpec, block: ComputeBlock, at_seq: int | None = None) -> float:
    """``block_seconds`` of one plain block; ``at_seq``: evaluate its fits at that length instead (0: the
    fixed part alone)."""
    b, s = block.micro_batch, block.seq_len
    comps = component_fits(profile, model, block.tp, b, s)
    s = s if at_seq is None else at_seq

    def seconds(parts: Sequence[ComponentFit], backward: bool) -> float:
        return sum(eval_fit(p.backward_s if backward else p.forward_s, b, s) for p in parts)

    layer, extra = layer_components(comps), extra_components(comps, block.first, block.last)
    out = block.layers * seconds(layer, block.backward) + seconds(extra, block.backward)
    if block.backward and block.recompute:
        out += block.layers * seconds(layer, False)
    return out


# Defaults for a spec profile derived from datasheet figures (see profiles/README.md for why).
GPU_EFFICIENCY = {"matmul_efficiency": 0.6, "attention_efficiency": 0.4, "memory_efficiency": 0.8}
CPU_EFFICIENCY = {"matmul_efficiency": 0.5, "attention_efficiency": 0.25, "memory_efficiency": 0.5}


def spec_profile(device_type: str, *, peak_tflops: float, hbm_bandwidth_gbs: float, memory_gib: float,
                 note: str, emulated: bool = False, matmul_efficiency: float | None = None,
                 attention_efficiency: float | None = None, memory_efficiency: float | None = None,
                 bandwidth_efficiency: float = 0.75, framework_overhead_gib: float | None = None,
                 slowdown: float = 1.0) -> DeviceProfile:
    """A ``provenance: spec`` profile from datasheet figures and achievable-efficiency factors.

    GPUs: bf16 autocast (2-byte activations, fp32 parameters), fused attention, ~8 us per kernel.
    Emulated CPU devices: fp32 activations, unfused attention, ~30 us per op dispatch.
    """
    eff = dict(CPU_EFFICIENCY if emulated else GPU_EFFICIENCY)
    eff.update({k: v for k, v in (("matmul_efficiency", matmul_efficiency), ("attention_efficiency",
                attention_efficiency), ("memory_efficiency", memory_efficiency)) if v is not None})
    compute = ComputeFigures(
        peak_tflops=peak_tflops, memory_bandwidth_gbs=hbm_bandwidth_gbs,
        kernel_overhead_s=_round(30e-6 * slowdown) if emulated else 8e-6, flash_attention=not emulated,
        activation_bytes=4 if emulated else 2, **eff)
    comm = CommFigures(p2p_latency_s=1e-3 if emulated else 20e-6,
                       allreduce_latency_s=1e-3 if emulated else 15e-6,
                       bandwidth_efficiency=bandwidth_efficiency)
    memory = MemoryFigures(cast_bytes=0.0 if emulated else 2.0, framework_overhead_gib=(0.3 if emulated else 2.0)
                           if framework_overhead_gib is None else framework_overhead_gib)
    # AdamW touches ~28 bytes per fp32 parameter (read p, g, m, v; write p, m, v).
    opt = OptimizerFit(seconds_per_param=_round(28.0 / (hbm_bandwidth_gbs * 1e9 * eff["memory_efficiency"])),
                       fixed_s=_round(compute.kernel_overhead_s * 20))
    return DeviceProfile(version=PROFILE_VERSION, device_type=device_type, provenance="spec",
                         memory_gib=memory_gib, compute=compute, comm=comm, memory=memory, optimizer=opt,
                         source=Source(note=note, slowdown=slowdown))


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def profile_from_device_type(name: str, dt: DeviceType) -> DeviceProfile:
    """The fallback for a type with no profile file: the cluster's own datasheet figures."""
    return spec_profile(name, peak_tflops=dt.peak_bf16_tflops, hbm_bandwidth_gbs=dt.hbm_bandwidth_gbs,
                        memory_gib=dt.memory_gib, emulated=dt.emulated,
                        slowdown=dt.emulate.slowdown if dt.emulate is not None else 1.0,
                        note="derived from the cluster file's datasheet figures (no profile found)")


@dataclass(frozen=True)
class ResolvedProfile:
    profile: DeviceProfile
    path: Path | None  # None: derived from the cluster file

    @property
    def origin(self) -> str:
        where = str(self.path) if self.path is not None else "cluster datasheet figures"
        return f"{self.profile.provenance} ({where})"


class ProfileSet(Mapping[str, DeviceProfile]):
    """The profile chosen for each device type of a cluster (read-only mapping by type name)."""

    def __init__(self, resolved: Mapping[str, ResolvedProfile]) -> None:
        self._resolved = dict(resolved)

    def __getitem__(self, name: str) -> DeviceProfile:
        return self._resolved[name].profile

    def __iter__(self):
        return iter(self._resolved)

    def __len__(self) -> int:
        return len(self._resolved)

    def resolved(self, name: str) -> ResolvedProfile:
        return self._resolved[name]


def resolve_profiles(device_types: Mapping[str, DeviceType] | Iterable[str],
                     dirs: Sequence[str | Path] = (), *, include_shipped: bool = True) -> ProfileSet:
    """Choose a profile per device type: measured beats imported beats spec; earlier directories beat later
    ones.

    ``device_types``: a cluster's ``device_types`` (types without any profile then fall back to the
    cluster's datasheet figures) or bare names (then every type must have a profile file).
    Two profiles of the same type and provenance in one directory are an error (which one is meant?).
    """
    search = [Path(d) for d in dirs]
    if include_shipped and PROFILES_DIR.is_dir() and all(p.resolve() != PROFILES_DIR for p in search):
        search.append(PROFILES_DIR)
    found: dict[tuple[str, str], tuple[int, Path, DeviceProfile]] = {}
    problems: list[Problem] = []
    for rank, d in enumerate(search):
        for path, prof in read_profile_dir(d):
            key = (prof.device_type, prof.provenance)
            prev = found.get(key)
            if prev is not None and prev[0] == rank:
                problems.append(Problem(str(path), "device_type", f"{prof.provenance} profile of "
                                        f"{prof.device_type!r} is also in {prev[1]}: keep one"))
            elif prev is None:
                found[key] = (rank, path, prof)
    if problems:
        raise SpecError(problems)
    names = list(device_types)
    out: dict[str, ResolvedProfile] = {}
    for name in names:
        hit = found.get((name, "measured")) or found.get((name, "imported")) or found.get((name, "spec"))
        if hit is not None:
            out[name] = ResolvedProfile(hit[2], hit[1])
        elif isinstance(device_types, Mapping):
            out[name] = ResolvedProfile(profile_from_device_type(name, device_types[name]), None)
        else:
            problems.append(Problem(", ".join(str(d) for d in search), "",
                                    f"no profile for device type {name!r}"))
    if problems:
        raise SpecError(problems)
    return ProfileSet(out)

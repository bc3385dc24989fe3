"""A sleep-mode emulated device type's target (runtime/torchfree/spec/cluster.py ``Emulation``), resolved: the profile
and model whose blocks it lasts, scaled to wall time. The cost model prices these types by it, and the CLI's
emulation harness (hetu_cli/emulation.py) gives the runtime the same prices as its block targets, so a plan and
its run agree. The runtime knows none of this: it sleeps out the durations it is handed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.costmodel.moe_gemms import MoeGemms, holder_rows
from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.profiling.profile import ComputeBlock, DeviceProfile, block_seconds, component_fits, load_profile
from runtime.torchfree.spec.catalog import load_model, resolve_profile_ref
from runtime.torchfree.spec.cluster import Emulation
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.moe import MoeSpec

# Sleep mode prices each half of a split backward (zero-bubble schedules: input gradient B, then weight
# gradient W) at this share of the backward block: the profiles time the backward as one block. The
# harness's block targets (hetu_cli/emulation.py) and the cost model's op costs (chunk_cost) read it here.
SPLIT_BACKWARD_SHARE = 0.5


@dataclass(frozen=True)
class SleepTarget:
    """A sleep-mode device type's target, resolved: the profile, the model whose shapes it runs, and the
    wall seconds one target second lasts (``runtime.torchfree.spec.cluster.Emulation``)."""

    profile: DeviceProfile
    model: ModelSpec
    time_scale: float
    seq_scale: int = 1          # target tokens per real token (``Emulation.seq_scale``)
    memory: bool = False        # the plan's memory is the target's (``Emulation.memory``)

    def block_s(self, block: ComputeBlock) -> float:
        """Wall seconds the block lasts on the emulated device (at least: unless its real compute overruns),
        its lengths (and its packed documents') priced at ``seq_scale`` target tokens per real token."""
        if self.seq_scale != 1:
            k = self.seq_scale
            block = dataclasses.replace(block, seq_len=block.seq_len * k,
                                        documents=tuple(n * k for n in block.documents))
        return self.time_scale * block_seconds(self.profile, self.model, block)

    def layer_s(self, tp: int, micro_batch: int, seq_len: int) -> float:
        """Wall seconds of one decoder layer's forward and backward blocks (the pace of a stage's TP parts)."""
        block = ComputeBlock(layers=1, micro_batch=micro_batch, seq_len=seq_len, backward=False, tp=tp,
                             recompute=False, first=False, last=False)
        return self.block_s(block) + self.block_s(dataclasses.replace(block, backward=True))

    def gemms(self, routing: MoeSpec, tp: int, micro_batch: int, seq_len: int) -> MoeGemms:
        """A MoE layer's GEMM blocks on the target (planner/costmodel/moe_gemms.py): the trained model's routing
        at the target's shapes and profile, ``seq_scale`` target tokens per token, in wall seconds."""
        mlp = component_fits(self.profile, self.model, tp, micro_batch, seq_len * self.seq_scale)["mlp"]
        return MoeGemms(routing, self.model, mlp, tp, micro_batch, seq_len, self.seq_scale, self.time_scale)


def slowest_target(targets: Mapping[str, SleepTarget], tp: int, micro_batch: int, seq_len: int) -> str:
    """Of the sleep-mode types sharing a stage (an expert-parallel stage may mix them), the one whose target
    prices a decoder layer longest: the pace its TP parts (attention, shared experts) run at."""
    return max(sorted(targets), key=lambda t: (targets[t].layer_s(tp, micro_batch, seq_len), t))


@dataclass(frozen=True)
class ExpertShare:
    """One device's part of an expert-parallel stage: the stage's devices in order, its placement ((device,
    experts) pairs or a mapping) and the device."""

    devices: tuple[int, ...]
    experts: Mapping[int, Sequence[int]]
    device: int

    def __post_init__(self) -> None:
        if self.device not in self.devices:
            raise ValueError(f"device {self.device} is not one of the stage's devices {list(self.devices)}")


def moe_block_s(stage_target: SleepTarget, own_target: SleepTarget, routing: MoeSpec, tp: int, micro_batch: int,
                seq_len: int, *, backward: bool, moe_layers: int, rerun_layers: int,
                share: ExpertShare | None = None) -> float:
    """Wall seconds ``moe_layers`` MoE layers add to a sleep-mode device's dense block (``rerun_layers`` of them
    re-running their forward in its backward): the router, experts and shared experts in place of the dense
    MLP, at the stage's pace (``stage_target``, its slowest type's, at TP ``tp``); on an expert-parallel stage
    (``share``) the device routes its slice and runs its own experts' rows on its own type (``own_target``)
    instead of every routed row split over the stage. The cost model prices the same (planner/costmodel/moe.py):
    the stage's block is its slowest device's."""
    g = stage_target.gemms(routing, tp, micro_batch, seq_len)
    f, b = g.tp_delta_s()
    if share is not None:
        got = holder_rows(share.devices, share.experts, g.rows())[share.device]
        df, db = own_target.gemms(routing, 1, micro_batch, seq_len).device_s(
            len(share.devices), sum(got.values()), sum(1 for r in got.values() if r > 0))
        rf, rb = g.routed_tp_s()
        f, b = f + df - rf, b + db - rb
    return moe_layers * b + rerun_layers * f if backward else moe_layers * f


def sleep_target(emulation: Emulation, *, trained: ModelSpec | None = None, file: str = "",
                 field: str = "emulate") -> SleepTarget:
    """Resolve a sleep-mode emulation's target (``load_cluster`` has checked that the names exist; a profile
    file that does not parse is reported against itself). A run of a mixture-of-experts model (``trained``)
    needs a MoE target: its expert shapes price the MoE layers."""
    target = emulation.target
    if target is None or emulation.time_scale is None:
        raise ValueError("not a sleep-mode emulation (no target)")
    path = resolve_profile_ref(target.profile)
    if path is None:
        raise SpecError([Problem(file, f"{field}.target.profile", f"unknown device profile {target.profile!r}")])
    model = load_model(target.model, file=file, field=f"{field}.target.model")
    if trained is not None and trained.moe is not None and model.moe is None:
        raise SpecError([Problem(file, f"{field}.target.model",
                                 f"{target.model!r} is a dense model; {trained.name} is a mixture of experts: its "
                                 "sleep-mode target must be one too (its expert shapes price the MoE layers)")])
    return SleepTarget(load_profile(path), model, emulation.time_scale, emulation.seq_scale,
                       emulation.memory == "target")

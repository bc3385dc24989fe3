"""A sleep-mode emulated device type's target (runtime/torchfree/spec/cluster.py ``Emulation``), resolved: the profile
and model whose blocks it lasts, scaled to wall time. The cost model prices these types by it, and the CLI's
emulation harness (hetu_cli/emulation.py) gives the runtime the same prices as its block targets, so a plan and
its run agree. The runtime knows none of this: it sleeps out the durations it is handed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.profiling.profile import ComputeBlock, DeviceProfile, block_seconds, load_profile
from runtime.torchfree.spec.catalog import load_model, resolve_profile_ref
from runtime.torchfree.spec.cluster import Emulation
from runtime.torchfree.spec.model import ModelSpec

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


def sleep_target(emulation: Emulation, *, file: str = "", field: str = "emulate") -> SleepTarget:
    """Resolve a sleep-mode emulation's target (``load_cluster`` has checked that the names exist; a
    profile file that does not parse is reported against itself)."""
    target = emulation.target
    if target is None or emulation.time_scale is None:
        raise ValueError("not a sleep-mode emulation (no target)")
    path = resolve_profile_ref(target.profile)
    if path is None:
        raise SpecError([Problem(file, f"{field}.target.profile", f"unknown device profile {target.profile!r}")])
    model = load_model(target.model, file=file, field=f"{field}.target.model")
    return SleepTarget(load_profile(path), model, emulation.time_scale, emulation.seq_scale,
                       emulation.memory == "target")

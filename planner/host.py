"""The emulated host as the planner models it: what sharing one machine's CPU costs emulated devices.

Their processes share the host's cores as the launcher pins them (runtime/profiling/host.py, which also
measures what the sharing costs). The cost model stretches compute by ``emulated_slowdown``; the other
effects only the simulator plays out (planner/simulate.py), but for the executor's CPU per boundary message
(``p2p_actions``), which the estimate charges too. A device type's measured effects all come
through ``_figures``; ``contended`` says whether its compute shares the cores at all (not for a
sleep-mode type: no core in ``cpu_layout``, and its blocks, which last their targets, pay no resume penalty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime.profiling.host import emulated_cpu_shares
from runtime.profiling.profile import (
    CoreHandoff,
    DeviceProfile,
    MeasuredModel,
    P2pActions,
    ProfileSet,
    ResumePenalty,
    log_interp,
)
from runtime.spec.cluster import Cluster
from runtime.spec.model import ModelSpec


@dataclass(frozen=True)
class HostModel:
    """The host effects on one model's devices of one cluster at one sequence length, from the profiles."""

    model: ModelSpec
    cluster: Cluster
    profiles: Mapping[str, DeviceProfile] | ProfileSet
    seq_len: int

    def _figures(self, device_type: str) -> DeviceProfile | None:
        """The profile holding the type's measured host figures (every measured effect reads them here)."""
        return self.profiles[device_type]

    def _measured(self, device_type: str) -> MeasuredModel | None:
        prof = self._figures(device_type)
        return None if prof is None else prof.measured_model(self.model)

    def emulated_slowdown(self, device_type: str) -> float:
        """The slowdown an emulated device type's compute blocks are stretched by (1 otherwise)."""
        em = self.cluster.device_types[device_type].emulate
        return em.slowdown if em is not None else 1.0

    def contended(self, device_type: str) -> bool:
        """Whether the shared cores and cold caches after idling apply to this type's compute: not for a
        sleep-mode type (runtime/spec/cluster.py ``Emulation``), whose blocks last their targets however the
        host runs the real work inside them (an overrun is reported by the runtime, not modelled)."""
        return not self.sleeps_to_target(device_type)

    def sleeps_to_target(self, device_type: str) -> bool:
        """Whether this type's forward / backward blocks sleep until they have lasted their targets (a
        sleep-mode type), however long the real work inside them took."""
        em = self.cluster.device_types[device_type].emulate
        return em is not None and em.sleeps

    def resume_penalty(self, device_type: str) -> ResumePenalty | None:
        """Extra CPU time of work that runs as it is after its device idled (measured profiles; None
        otherwise). A sleep-mode type's blocks last their targets and never pay it, but its optimizer step
        runs as it is, after the device slept through its blocks: traced (docs/benchmarks.md "Simulator
        fidelity", stop 34), that step took 1.6-2.3x its back-to-back price on every sleep-mode device."""
        m = self._measured(device_type)
        return None if m is None else m.resume

    def comm_wake(self, device_type: str) -> ResumePenalty | None:
        """How much later a device blocked in communication resumes after waiting (measured profiles)."""
        prof = self._figures(device_type)
        return None if prof is None else prof.comm.p2p_wake

    def p2p_actions(self, device_type: str) -> P2pActions | None:
        """The executor's CPU per boundary-message action on this type (measured profiles of CPU hosts;
        None otherwise: nothing charged). Also for a sleep-mode type: its blocks sleep to their targets, but
        the posts and waits between them run as they are."""
        prof = self._figures(device_type)
        return None if prof is None else prof.comm.p2p_actions

    def shared_core_delay(self, devices: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> float:
        """How much later a boundary message from stage ``src`` to ``dst`` arrives because the launcher pins
        a sender and its receiver to one core (the plan's ``devices`` decide the pinning): the measured
        ``CommFigures.shared_core_p2p_s`` of the sender's type, the sender going on computing after its post
        as a stage does. Only between sleep-mode devices: where compute contends for the cores, the
        simulator plays the busy core's delays per op instead (``CoreHandoff.recv_wake_s``)."""
        if any(self.contended(self.cluster.device(d).type) for d in (*src, *dst)):
            return 0.0
        pinned = self.pinning(devices)
        shared = [a for a, b in zip(src, dst) if set(pinned.get(a, ())) & set(pinned.get(b, ()))]
        figures = [self._figures(self.cluster.device(a).type) for a in shared]
        return max((p.comm.shared_core_p2p_s for p in figures if p is not None), default=0.0)

    def core_sharing(self, device_type: str, block_s: float = 0.0) -> float:
        """Efficiency of two emulated devices' processes time-sharing one CPU core, at this sequence length
        (measured profiles: interpolated in log length between the measured ones; 1 otherwise), for a
        stage whose forward + backward take ``block_s`` CPU seconds (``SharingCurve``; 0: the smallest
        block measured)."""
        m = self._measured(device_type)
        if m and m.core_sharing_curve:
            return log_interp(sorted((s, c.at(block_s)) for s, c in m.core_sharing_curve.items()), self.seq_len)
        return log_interp(sorted(m.core_sharing.items()), self.seq_len) if m and m.core_sharing else 1.0

    def core_handoff(self, device_type: str) -> CoreHandoff | None:
        """The scheduler's delays around a compute block of an emulated device whose core's other process
        computes, at this sequence length (measured profiles: interpolated in log length; None otherwise)."""
        m = self._measured(device_type)
        if m is None or not m.core_handoff:
            return None
        pts = sorted(m.core_handoff.items())
        return CoreHandoff(**{f.name: max(0.0, log_interp([(s, getattr(h, f.name)) for s, h in pts], self.seq_len))
                              for f in dataclasses.fields(CoreHandoff)})

    def host_cores(self, node: str) -> int | None:
        """CPU cores shared by the emulated devices of ``node`` (from their measured profiles), or None
        when its devices do not share a CPU (real accelerators, or no measured figure)."""
        if not self.cluster.emulated:
            return None
        figures = [self._figures(d.type) for d in self.cluster.devices if d.node == node]
        known = [p.compute.host_cores for p in figures if p is not None and p.compute.host_cores]
        return min(known) if known else None

    def pinning(self, devices: Sequence[int]) -> dict[int, tuple[int, ...]]:
        """Device -> the cores the launcher pins its worker to, for a strategy's ``devices``
        (runtime/profiling/host.py ``emulated_cpu_shares``); empty when the devices do not share CPUs."""
        known = [c for n in {d.node for d in self.cluster.devices} if (c := self.host_cores(n))]
        if not known:
            return {}
        return emulated_cpu_shares(devices, self.cluster.num_devices, range(min(known)))[1]

    def cpu_layout(self, devices: Sequence[int]) -> tuple[dict[str, float], dict[int, list[tuple[str, float]]]]:
        """The cores each of a strategy's ``devices`` runs on, as the launcher pins its workers: (cores per
        host, device -> [(host, demand)]), one host per core; empty when the devices do not share CPUs."""
        pinned = self.pinning(devices)
        # Sleep-mode devices are pinned too, but their blocks last their targets: they share no core.
        shares = {d: cs for d, cs in pinned.items() if self.contended(self.cluster.device(d).type)}
        cores = {f"core {c}": 1.0 for cs in shares.values() for c in cs}
        return cores, {d: [(f"core {c}", 1.0) for c in cs] for d, cs in shares.items()}

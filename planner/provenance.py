"""Which profile priced each device type, and what in it was measured: ``hspmd plan`` and ``hspmd simulate``
print it, plans record it (``Plan.profiles``), and what would otherwise be a silent assumption becomes a
warning or an error.

Per device type and TP degree a component's time comes from (the rule of ``component_fits``):
* **measured**: a table (or a measured fit) of this model's shape at this TP degree;
* **scaled**: a table at the nearest measured TP degree, scaled by the derived fits' ratio
  (runtime/torchfree/profiling/tables.py);
* **derived**: the profile's throughput figures (peak TFLOPS times efficiencies, memory bandwidth) through
  the analytic per-component model; for a type with no profile file at all, the cluster file's datasheet
  figures with default efficiencies (provenance ``datasheet``).

Checks (``check_profiles``): a (GPU) type priced from datasheet figures warns and names the nearest profile names
(``difflib``); a ``--profile`` directory holding profiles of types the cluster does not name warns; a measured
or imported profile from a ``--profile`` directory that holds measurements of other models only is an error
naming the fields that differ (it would otherwise price this model from its datasheet figures while being
listed as used).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.profiling.profile import (
    COMPONENTS,
    PROFILES_DIR,
    DeviceProfile,
    MeasuredModel,
    ProfileSet,
    read_profile_dir,
)
from runtime.torchfree.profiling.tables import nearest_degree
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import Plan, ProfileRecord

# The shape fields a measured model must share with the model it prices (``MeasuredModel.matches``).
SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads", "vocab_size", "architecture")


def component_source(profile: DeviceProfile, model: ModelSpec, tp: int, component: str) -> tuple[str, int | None]:
    """("measured" | "scaled" | "derived", the TP degree scaled from) for one component at one TP degree,
    by ``component_fits``' rule."""
    return measured_source(profile.measured_model(model), tp, component)


def measured_source(m: MeasuredModel | None, tp: int, component: str) -> tuple[str, int | None]:
    """``component_source`` within one measured model (None: the model was not measured)."""
    if m is None:
        return "derived", None
    by_tp = sorted(t for t, comps in m.tables.items() if component in comps)
    if tp in by_tp or tp in m.tp:
        return "measured", None
    if by_tp:
        return "scaled", nearest_degree(by_tp, tp)
    return "derived", None


def unmeasured(m: MeasuredModel) -> dict[int, dict[str, tuple[str, int | None]]]:
    """Per TP degree the measured model has measurements at, the components it does not measure there and
    where their times come from instead (scaled from another degree, or derived from the figures)."""
    out = {}
    for tp in sorted(set(m.tables) | set(m.tp)):
        missing = {c: measured_source(m, tp, c) for c in COMPONENTS}
        missing = {c: how for c, how in missing.items() if how[0] != "measured"}
        if missing:
            out[tp] = missing
    return out


def unmeasured_text(m: MeasuredModel) -> list[str]:
    """``unmeasured`` as lines: 'tp1: embedding, head derived from the profile's figures'."""
    lines = []
    for tp, missing in unmeasured(m).items():
        groups: dict[str, list[str]] = {}
        for c, (how, base) in missing.items():
            groups.setdefault("derived from the profile's figures" if how == "derived" else f"scaled from tp{base}",
                              []).append(c)
        lines.append(f"tp{tp}: " + "; ".join(f"{', '.join(cs)} {how}" for how, cs in groups.items()))
    return lines


@dataclass(frozen=True)
class TypeProvenance:
    """One device type's profile and what in it priced the plan's TP degrees."""

    device_type: str
    provenance: str                 # measured, imported, spec, datasheet
    path: Path | None
    shipped: bool
    sources: Mapping[int, Mapping[str, tuple[str, int | None]]]   # tp -> component -> component_source

    def lists(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {"measured": [], "scaled": [], "derived": []}
        for tp, comps in sorted(self.sources.items()):
            for comp, (how, base) in comps.items():
                out[how].append(f"{comp}@tp{tp}" + (f" from tp{base}" if how == "scaled" else ""))
        return {k: tuple(v) for k, v in out.items()}

    def record(self, plan_file: Path | None = None) -> ProfileRecord:
        """What a plan file records: the path relative to the plan file (a shipped profile by file name)."""
        path = None
        if self.path is not None:
            path = self.path.name if self.shipped else _relative(self.path, plan_file)
        return ProfileRecord(provenance=self.provenance, path=path, shipped=self.shipped, **self.lists())

    def line(self) -> str:
        """``profile H100: imported (prof/H100.imported.yaml); measured tp1: attention, mlp; ...``."""
        where = "cluster datasheet figures" if self.path is None else str(self.path)
        parts = []
        for tp, comps in sorted(self.sources.items()):
            groups: dict[str, list[str]] = {}
            for comp, (how, base) in comps.items():
                groups.setdefault(how if how != "scaled" else f"scaled from tp{base}", []).append(comp)
            if list(groups) == ["derived"]:
                parts.append(f"tp{tp} derived from its figures")
            else:
                parts.append(f"tp{tp} " + "; ".join(f"{how}: {', '.join(c)}" for how, c in groups.items()))
        return f"profile {self.device_type}: {self.provenance} ({where})" + (f"; {'; '.join(parts)}" if parts else "")

    def to_json(self) -> dict[str, Any]:
        return {"provenance": self.provenance, "path": None if self.path is None else str(self.path),
                "shipped": self.shipped, **{k: list(v) for k, v in self.lists().items()}}


def _relative(path: Path, plan_file: Path | None) -> str:
    if plan_file is None:
        return str(path)
    try:
        return os.path.relpath(path.resolve(), Path(plan_file).absolute().parent.resolve())
    except ValueError:   # another drive
        return str(path.resolve())


def _shipped(path: Path | None) -> bool:
    return path is not None and path.resolve().parent == PROFILES_DIR.resolve()


def provenance(profiles: ProfileSet, model: ModelSpec, tps: Mapping[str, Iterable[int]]) -> dict[str, TypeProvenance]:
    """Per device type of ``profiles``: its provenance, and per TP degree in ``tps[type]`` (those the plan
    uses; none for a type it leaves idle) where each component's time comes from."""
    out = {}
    for name in profiles:
        r = profiles.resolved(name)
        prov = "datasheet" if r.path is None else r.profile.provenance
        sources = {tp: {c: component_source(r.profile, model, tp, c) for c in COMPONENTS}
                   for tp in sorted(set(tps.get(name, ())))}
        out[name] = TypeProvenance(name, prov, r.path, _shipped(r.path), sources)
    return out


def strategy_tps(plan: Plan, cluster: Cluster) -> dict[str, set[int]]:
    """The TP degrees each device type runs at in any of the plan's strategies."""
    out: dict[str, set[int]] = {}
    for s in plan.strategies:
        for p in s.pipelines:
            for st in p.stages:
                out.setdefault(cluster.device(st.devices[0]).type, set()).add(st.tp)
    return out


def known_profile_types(dirs: Sequence[str | Path]) -> dict[str, Path]:
    """Device type -> profile file, over the ``--profile`` directories and the shipped profiles."""
    out: dict[str, Path] = {}
    for d in [*dirs, PROFILES_DIR]:
        if Path(d).is_dir():
            for path, prof in read_profile_dir(d):
                out.setdefault(prof.device_type, path)
    return out


def mismatch(measured: MeasuredModel, model: ModelSpec) -> list[str]:
    """The shape fields in which a profile's measured model differs from ``model``: 'hidden_size 4096 (model
    5120)'."""
    return [f"{f} {getattr(measured, f)} (model {getattr(model, f)})" for f in SHAPE_FIELDS
            if getattr(measured, f) != getattr(model, f)]


def check_profiles(profiles: ProfileSet, model: ModelSpec, cluster: Cluster, dirs: Sequence[str | Path],
                   cluster_file: str = "--cluster") -> list[str]:
    """Warnings (one line each) about how the cluster's types were priced; raises SpecError for a profile
    from ``dirs`` measured for other models only."""
    warnings = []
    known: dict[str, Path] | None = None   # read only when a type needs a suggestion
    problems = []
    for name in profiles:
        r = profiles.resolved(name)
        if r.path is None:
            if cluster.device_types[name].emulated:   # CPU test harness types: priced by their emulation
                continue
            known = known_profile_types(dirs) if known is None else known
            near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
            hint = f" (did you mean {' or '.join(near)}? profiles are matched on their device_type)" if near else ""
            warnings.append(f"device type {name!r} of {cluster_file} has no profile: priced from the cluster file's "
                            f"datasheet figures with default efficiencies{hint}")
            continue
        p = r.profile
        if p.provenance in ("measured", "imported") and p.models and p.measured_model(model) is None \
                and not _shipped(r.path):
            for key, mm in p.models.items():
                problems.append(Problem(str(r.path), f"models.{key}", f"measured for another model than "
                                        f"{model.name}: {'; '.join(mismatch(mm, model))}; measure or import this "
                                        "model, or leave this profile out of --profile"))
    if problems:
        raise SpecError(problems)
    for d in dirs:
        if not Path(d).is_dir():
            continue
        for path, prof in read_profile_dir(d):
            if prof.device_type not in cluster.device_types:
                near = difflib.get_close_matches(prof.device_type, list(cluster.device_types), n=1, cutoff=0.5)
                hint = f" (is {near[0]!r} the same device? name it {prof.device_type!r} there)" if near else ""
                warnings.append(f"--profile {d}: {path.name} is for device type {prof.device_type!r}, which "
                                f"{cluster_file} does not name (its types: {', '.join(cluster.device_types)}): "
                                f"not used{hint}")
    return warnings


def recorded_difference(plan: Plan, now: Mapping[str, TypeProvenance], plan_dir: Path) -> list[str]:
    """The device types whose profile differs from the one the plan records, one sentence each."""
    out = []
    for name, rec in (plan.profiles or {}).items():
        cur = now.get(name)
        if cur is None:
            continue
        was = _identity(rec.path, rec.shipped, plan_dir)
        if (rec.provenance, was) == (cur.provenance, _identity(cur.path and str(cur.path), cur.shipped, Path.cwd())):
            continue
        hint = ""
        if not rec.shipped and rec.path is not None:
            hint = f"; pass --profile {Path(was or '').parent} to price it as the plan did"
        out.append(f"{name} was priced by its {rec.provenance} profile ({rec.path or 'cluster datasheet figures'}) "
                   f"when the plan was made, now by its {cur.provenance} one "
                   f"({cur.path or 'cluster datasheet figures'}){hint}")
    return out


def _identity(path: str | None, shipped: bool, base: Path) -> str | None:
    """A recorded profile path as something to compare: a shipped file's name, else its resolved path."""
    if path is None:
        return None
    if shipped:
        return Path(path).name
    try:
        return str((base / path).resolve())
    except (OSError, ValueError):   # a hostile plan file's path (a NUL, a loop): compared as written
        return path


def with_profiles(plan: Plan, profiles: ProfileSet, model: ModelSpec, cluster: Cluster,
                  plan_file: Path | None) -> Plan:
    """``plan`` recording the profiles that priced its device types (paths relative to ``plan_file``)."""
    priced = provenance(profiles, model, strategy_tps(plan, cluster))
    return dataclasses.replace(plan, profiles={n: t.record(plan_file) for n, t in priced.items()})

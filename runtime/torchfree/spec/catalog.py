"""Finding specs: catalog names (configs/models, configs/clusters) or paths, and loading them.

A model may also be a Hugging Face model directory or its ``config.json`` (runtime/torchfree/spec/hf.py); this is
the one place that tells the two apart, so every command taking ``--model`` or a plan's ``model:`` accepts
both."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.spec.cluster import Cluster
from runtime.torchfree.spec.hf import config_file, is_hf_config, load_hf_model
from runtime.torchfree.spec.io import atomic_write_text, dump_yaml, is_dir, is_file, load_file
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import PLAN_VERSION, Plan, Strategy
from runtime.torchfree.spec.schema import to_data
from runtime.torchfree.spec.validate import validate_plan

CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs"
# The shipped device profiles (runtime/torchfree/profiling/profile.py reads them).
PROFILES_DIR = CONFIGS_DIR.parent / "profiles"


def catalog_names(kind: str) -> list[str]:
    """Names of the shipped specs of one kind ('models', 'clusters', 'plans')."""
    return sorted(p.stem for p in (CONFIGS_DIR / kind).glob("*.yaml"))


def looks_like_path(ref: str) -> bool:
    """A reference the user meant as a path, not a catalog name."""
    return ref.endswith((".yaml", ".yml", ".json")) or "/" in ref or "\\" in ref


def _path_ref(ref: str, kind: str, relative_to: Path | None) -> Path | None:
    candidates = [Path(ref)]
    if relative_to is not None and not Path(ref).is_absolute():
        candidates.insert(0, relative_to / ref)
    for c in candidates:
        if kind == "models":
            c = config_file(c)  # a Hugging Face model directory stands for its config.json
        if is_file(c):
            return c
    return None


def unusable_path(ref: str, kind: str, relative_to: Path | None = None) -> str | None:
    """Why a reference that names something on disk still names no spec file (a directory without a
    config.json, a config.json that is a directory, a device or pipe), or None when nothing is there: the
    error then says that, not "unknown"."""
    if not ref.strip():
        return None
    candidates = [Path(ref)] if relative_to is None or Path(ref).is_absolute() else [relative_to / ref, Path(ref)]
    for c in candidates:
        try:
            if not os.path.lexists(c):
                continue
        except (OSError, ValueError):
            continue
        if is_dir(c):
            if kind != "models":
                return f"{str(c)!r} is a directory, not a YAML file"
            inner = config_file(c)
            if os.path.lexists(inner) and not is_file(inner):
                return f"{str(inner)!r} is not a regular file"
            return f"{str(c)!r} is a directory without a {inner.name}"
        if not is_file(c):
            return f"{str(c)!r} is not a regular file (or cannot be read)"
    return None


def resolve_ref(ref: str, kind: str, relative_to: Path | None = None) -> Path | None:
    """Path of a spec given by name or path; None when no such file or catalog entry exists.

    A bare name is a catalog entry first; for models, else a Hugging Face model directory of that name
    (``--model Llama-3.2-1B`` beside a downloaded model). An empty or blank reference names nothing: as a
    path it was the plan's own directory, whose config.json (if any) ``model: ""`` then loaded."""
    if not ref.strip():
        return None
    if looks_like_path(ref):
        return _path_ref(ref, kind, relative_to)
    p = CONFIGS_DIR / kind / f"{ref}.yaml"
    if is_file(p):
        return p
    return _path_ref(ref, kind, relative_to) if kind == "models" else None


def recorded_ref(ref: str, kind: str, relative_to: Path | None = None, plan_file: Path | None = None) -> str:
    """What a plan file records for a spec reference: a catalog name as is; a path relative to the directory
    of ``plan_file`` (the plan and its cluster and model files move together), or absolute when there is no
    plan file or no relative path from it (another drive)."""
    path = resolve_ref(ref, kind, relative_to)
    if path is None or path.parent == CONFIGS_DIR / kind and not looks_like_path(ref):
        return ref
    if plan_file is not None:
        try:
            rel = os.path.relpath(path.resolve(), Path(plan_file).absolute().parent.resolve())
        except ValueError:
            return str(path.resolve())
        # A bare file name would read as a catalog name: keep the ./ that marks it as a path.
        return rel if looks_like_path(rel) else f"./{rel}"
    return str(path.resolve())


def missing_path(ref: str, kind: str, relative_to: Path | None = None) -> str | None:
    """"file not found" for a reference that reads as a path (a slash or a YAML/JSON suffix) to nothing, with
    where it was looked for; None otherwise."""
    if not looks_like_path(ref):
        return None
    where = [Path(ref)] if relative_to is None or Path(ref).is_absolute() else [relative_to / ref, Path(ref)]
    for w in where:
        try:
            os.lstat(w)
        except FileNotFoundError:
            continue
        except (OSError, ValueError):   # a name too long, a file on the way: not "not found"
            return None
        return None
    looked = " or ".join(dict.fromkeys(str(w) for w in where))
    return f"{kind[:-1]} {ref!r}: file not found (looked for {looked})"


def resolve_profile_ref(ref: str, relative_to: Path | None = None) -> Path | None:
    """Path of a device profile given by a shipped profile's file name (``H20``: profiles/H20.yaml) or a
    path; None when there is none."""
    if looks_like_path(ref):
        return resolve_ref(ref, "profiles", relative_to)
    p = PROFILES_DIR / f"{ref}.yaml"
    return p if is_file(p) else None


def resolved_or_refused(ref: str, kind: str, paths: str, relative_to: Path | None, file: str, field: str) -> Path:
    """The file ``ref`` names among ``kind`` ("models", "clusters"), or one problem saying why there is none:
    a path that does not exist, one that cannot be read, or a name the catalog lacks (``paths``: what else
    the reference may be)."""
    path = resolve_ref(ref, kind, relative_to)
    if path is not None:
        return path
    missing = missing_path(ref, kind, relative_to)
    if missing is not None:
        raise SpecError([Problem(file, field, missing)])
    noun = kind.rstrip("s")
    why = unusable_path(ref, kind, relative_to)
    if why is not None:
        raise SpecError([Problem(file, field, f"{noun} {ref!r}: {why}")])
    raise SpecError([Problem(file, field, f"unknown {noun} {ref!r} (catalog: {', '.join(catalog_names(kind))}; "
                                          f"or {paths})")])


def load_model(ref: str, *, relative_to: Path | None = None, file: str = "", field: str = "model") -> ModelSpec:
    path = resolved_or_refused(ref, "models", "a path to a YAML file, a Hugging Face config.json or its directory",
                               relative_to, file, field)
    return load_hf_model(path) if is_hf_config(path) else load_file(ModelSpec, path)


def model_source_config(ref: str, relative_to: Path | None = None) -> Path | None:
    """The Hugging Face config.json a model reference names, or None (catalog entry, model YAML)."""
    path = resolve_ref(ref, "models", relative_to)
    return path if path is not None and is_hf_config(path) else None


def load_cluster(ref: str, *, relative_to: Path | None = None, file: str = "",
                 field: str = "cluster") -> Cluster:
    path = resolved_or_refused(ref, "clusters", "a path to a YAML file", relative_to, file, field)
    cluster = load_file(Cluster, path)
    problems = emulation_target_problems(cluster, str(path))
    if problems:
        raise SpecError(problems)
    return cluster


def emulation_target_problems(cluster: Cluster, file: str) -> list[Problem]:
    """Sleep-mode targets that name no profile or no model. Checked here, where the cluster file is
    known, so a typo is reported against it (not later, by whichever process first prices a block)."""
    out: list[Problem] = []
    for name, dt in cluster.device_types.items():
        target = dt.emulate.target if dt.emulate is not None else None
        if target is None:
            continue
        where = f"device_types.{name}.emulate.target"
        if resolve_profile_ref(target.profile) is None:
            shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
            out.append(Problem(file, f"{where}.profile", f"unknown device profile {target.profile!r} (shipped: "
                               f"{', '.join(shipped)}; or a path to a profile file)"))
        if resolve_ref(target.model, "models") is None:
            out.append(Problem(file, f"{where}.model", f"unknown model {target.model!r} (catalog: "
                               f"{', '.join(catalog_names('models'))}; or a path to a YAML file)"))
    return out


def load_plan(path: str | Path) -> Plan:
    """Parse and type-check a plan file (no cross-checks against model and cluster)."""
    return load_file(Plan, Path(path), version=PLAN_VERSION)


def dump_plan(plan: Plan) -> str:
    return dump_yaml(to_data(plan))


def save_plan(plan: Plan, path: str | Path) -> None:
    atomic_write_text(path, dump_plan(plan))


@dataclass(frozen=True)
class PlanContext:
    """A plan with the model and cluster it refers to, all three validated together."""

    plan: Plan
    model: ModelSpec
    cluster: Cluster
    path: Path

    def strategy(self, name: str | None = None) -> Strategy:
        """The named strategy (``--strategy``), or the plan's first; an unknown name (or "") names the plan."""
        if name is not None and name not in (names := [s.name for s in self.plan.strategies]):
            raise SpecError([Problem(str(self.path), "--strategy", f"no strategy named {name!r} (the plan has: "
                                                                   f"{', '.join(names)})")])
        return self.plan.strategy(name)


def load_plan_context(path: str | Path, cluster: str | None = None, model: str | None = None) -> PlanContext:
    """Load a plan, resolve its model and cluster (or ``cluster``, ``model`` instead: ``--cluster``,
    ``--model``), validate everything.

    Raises one SpecError listing every problem, whichever file it is in.
    """
    path = Path(path)
    plan = load_plan(path)
    problems: list[Problem] = []
    model_spec = cluster_spec = None
    try:
        model_spec = (load_model(model, file="--model", field="") if model is not None
                      else load_model(plan.model, relative_to=path.parent, file=str(path)))
    except SpecError as err:
        problems.extend(err.problems)
    try:
        cluster_spec = (load_cluster(cluster, file="--cluster", field="") if cluster is not None
                        else load_cluster(plan.cluster, relative_to=path.parent, file=str(path)))
    except SpecError as err:
        problems.extend(err.problems)
    if model_spec is not None and cluster_spec is not None:
        problems.extend(validate_plan(plan, model_spec, cluster_spec, str(path)))
    if problems:
        raise SpecError(problems)
    assert model_spec is not None and cluster_spec is not None
    if model is not None or cluster is not None:   # what the run uses, so every later reader of the plan agrees
        plan = dataclasses.replace(plan, model=plan.model if model is None else recorded_ref(model, "models"),
                                   cluster=plan.cluster if cluster is None else recorded_ref(cluster, "clusters"))
    return PlanContext(plan, model_spec, cluster_spec, path)


def check_trainable(ctx: PlanContext) -> None:
    """Refuse what in the plan's model the runtime cannot train (the planner prices it regardless), naming
    the model's file and field."""
    found = ctx.model.train_problem(ctx.plan.training.seq_len)
    if found is not None:
        path = resolve_ref(ctx.plan.model, "models", ctx.path.parent)
        raise SpecError([Problem(str(path or ctx.plan.model), found[0], found[1])])
    if ctx.model.moe is not None and ctx.plan.training.tokens_per_step is not None:
        raise SpecError([Problem(str(ctx.path), "training.tokens_per_step",
                                 "a MoE model does not train on packed documents yet (its load-balancing loss is "
                                 "weighted by fixed micro-batches)")])

"""Finding specs: catalog names (configs/models, configs/clusters) or paths, and loading them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runtime.errors import Problem, SpecError
from runtime.spec.cluster import Cluster
from runtime.spec.io import atomic_write_text, dump_yaml, load_file
from runtime.spec.model import ModelSpec
from runtime.spec.plan import PLAN_VERSION, Plan
from runtime.spec.schema import to_data
from runtime.spec.validate import validate_plan

T = TypeVar("T")

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def catalog_names(kind: str) -> list[str]:
    """Names of the shipped specs of one kind ('models', 'clusters', 'plans')."""
    return sorted(p.stem for p in (CONFIGS_DIR / kind).glob("*.yaml"))


def _looks_like_path(ref: str) -> bool:
    return ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref


def resolve_ref(ref: str, kind: str, relative_to: Path | None = None) -> Path | None:
    """Path of a spec given by name or path; None when no such file or catalog entry exists."""
    if _looks_like_path(ref):
        candidates = [Path(ref)]
        if relative_to is not None and not Path(ref).is_absolute():
            candidates.insert(0, relative_to / ref)
        for c in candidates:
            if c.is_file():
                return c
        return None
    p = CONFIGS_DIR / kind / f"{ref}.yaml"
    return p if p.is_file() else None


def _load(cls: type[T], path: Path) -> T:
    return load_file(cls, path)


def load_model(ref: str, *, relative_to: Path | None = None, file: str = "", field: str = "model") -> ModelSpec:
    path = resolve_ref(ref, "models", relative_to)
    if path is None:
        raise SpecError([Problem(file, field, f"unknown model {ref!r} (catalog: "
                                 f"{', '.join(catalog_names('models'))}; or a path to a YAML file)")])
    return _load(ModelSpec, path)


def load_cluster(ref: str, *, relative_to: Path | None = None, file: str = "",
                 field: str = "cluster") -> Cluster:
    path = resolve_ref(ref, "clusters", relative_to)
    if path is None:
        raise SpecError([Problem(file, field, f"unknown cluster {ref!r} (catalog: "
                                 f"{', '.join(catalog_names('clusters'))}; or a path to a YAML file)")])
    return _load(Cluster, path)


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


def load_plan_context(path: str | Path, cluster: str | None = None) -> PlanContext:
    """Load a plan, resolve its model and cluster (or ``cluster`` instead), validate everything.

    Raises one SpecError listing every problem, whichever file it is in.
    """
    path = Path(path)
    plan = load_plan(path)
    problems: list[Problem] = []
    model = cluster_spec = None
    try:
        model = load_model(plan.model, relative_to=path.parent, file=str(path))
    except SpecError as err:
        problems.extend(err.problems)
    try:
        if cluster is not None:
            cluster_spec = load_cluster(cluster, file="--cluster", field="")
        else:
            cluster_spec = load_cluster(plan.cluster, relative_to=path.parent, file=str(path))
    except SpecError as err:
        problems.extend(err.problems)
    if model is not None and cluster_spec is not None:
        problems.extend(validate_plan(plan, model, cluster_spec, str(path)))
    if problems:
        raise SpecError(problems)
    assert model is not None and cluster_spec is not None
    return PlanContext(plan, model, cluster_spec, path)

"""``hspmd plan --expert-load FILE``: the router's skew measured by a run, in place of the model file's
``moe.expert_load``. FILE is the metrics of ``hspmd train --metrics`` (JSON lines; each MoE step records
``expert_load``, the tokens each expert was given summed over the MoE layers), whose steps are added up, or
a YAML / JSON list of one share (or count) per expert."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from runtime.torchfree.errors import Problem, SpecError
from runtime.torchfree.spec.io import read_text, read_yaml
from runtime.torchfree.spec.model import ModelSpec

OPTION = "--expert-load"


def refuse(path: Path, message: str) -> SpecError:
    return SpecError([Problem(OPTION, "", f"{path}: {message}")])


def _metrics_rows(text: str) -> list[dict] | None:
    """The JSON objects of a JSON-lines file, or None where it is not one."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(row, dict):
            return None
        rows.append(row)
    return rows or None


def read_expert_load(path: Path, num_experts: int) -> tuple[tuple[float, ...], str]:
    """(tokens or shares per expert, where they came from) read from ``path`` (the module's formats)."""
    rows = _metrics_rows(read_text(path))
    if rows is not None:
        loads = [r["expert_load"] for r in rows if "expert_load" in r]
        if not loads:
            raise refuse(path, "no step records expert_load (metrics of a mixture-of-experts run of "
                               "`hspmd train --metrics`)")
        where = f"the {len(loads)} steps of {path}"
    else:
        data = read_yaml(path)
        if not isinstance(data, list):
            raise refuse(path, f"expected a list of {num_experts} shares or the metrics of `hspmd train "
                               f"--metrics`, got {type(data).__name__}")
        loads, where = [data], str(path)
    total = [0.0] * num_experts
    for i, load in enumerate(loads):
        if not isinstance(load, list) or len(load) != num_experts:
            raise refuse(path, f"expert_load of entry {i + 1} has {len(load) if isinstance(load, list) else 'no'} "
                               f"values, the model has {num_experts} experts")
        for e, x in enumerate(load):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise refuse(path, f"expert_load of entry {i + 1}: expert {e}: expected a number >= 0, got {x!r}")
            total[e] += float(x)
    if sum(total) <= 0:
        raise refuse(path, "every expert's load is 0 (no token routed)")
    return tuple(total), where


def with_measured_load(model: ModelSpec, path: Path) -> tuple[ModelSpec, str]:
    """``model`` planned under the router skew ``path`` measured, and the note saying so."""
    if model.moe is None:
        raise SpecError([Problem(OPTION, "", f"{model.name} is not a mixture-of-experts model")])
    load, where = read_expert_load(path, model.moe.num_experts)
    shares = tuple(x / sum(load) for x in load)
    mean = 1.0 / len(shares)
    note = (f"{model.name}: expert load measured over {where} (hottest expert {max(shares) / mean:.2f}x the mean, "
            f"coldest {min(shares) / mean:.2f}x) in place of the model file's")
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, expert_load=shares)), note

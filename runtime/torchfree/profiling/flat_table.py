"""Flat tables of measurements made elsewhere <-> profiles: ``hspmd profile import`` and ``export``.

Teams time their layers with Megatron, DeepSpeed or torch.profiler; a flat table (CSV with a header
row, or JSON: a list of row objects) is the common denominator. One row per measurement, its ``kind``
saying which: ``compute``, ``link``, ``allreduce`` or ``iteration`` (their columns: ``FIELDS``; their
meaning and an example: docs/profiles.md).

Each (component, TP degree[, layer]) must cover every combination of its micro-batch sizes and sequence
lengths (a full grid: runtime/torchfree/profiling/tables.py interpolates on it). A bad row is one problem naming
``FILE:ROW`` (the CSV line, or the JSON row counted from 1) and the field. Imports no torch.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from runtime.torchfree.errors import FieldErrors, Problem, SpecError
from runtime.torchfree.profiling.layer_rows import LAYER_ROW, split_layer_table
from runtime.torchfree.profiling.profile import COMPONENTS, LAYER_COMPONENTS, DeviceProfile, MeasuredModel, eval_fit
from runtime.torchfree.profiling.tables import ComponentTable, LinkCurve, LinkCurves, curve_point_problem
from runtime.torchfree.spec.io import atomic_write_text, read_json, read_text
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.schema import MAX_FLOAT, MAX_INT, figure_problem, number_text_problem

TableFormat = Literal["csv", "json"]
KINDS = ("compute", "link", "allreduce", "iteration")
# Every column a row may have, in the order an export writes them.
COLUMNS = ("kind", "component", "layer", "tp", "micro_batch", "seq_len", "forward_s", "backward_s", "optimizer_s",
           "link", "direction", "group", "bytes", "bandwidth_gbs", "seconds")
# Per kind: (required columns, optional columns); any other non-empty column is an error.
FIELDS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "compute": (("component", "tp", "micro_batch", "seq_len", "forward_s", "backward_s"), ("optimizer_s", "layer")),
    "link": (("link", "direction", "bytes", "bandwidth_gbs"), ()),
    "allreduce": (("link", "group", "bytes", "bandwidth_gbs"), ()),
    "iteration": (("seconds",), ()),
}
INTS = {"layer": 0, "tp": 1, "micro_batch": 1, "seq_len": 1, "group": 2, "bytes": 1}   # column -> least value
FLOATS = ("forward_s", "backward_s", "optimizer_s", "seconds", "bandwidth_gbs")        # finite, >= 0 (bw > 0)
CHOICES = {"component": (*COMPONENTS, LAYER_ROW), "link": ("intra", "inter"), "direction": ("send", "recv"),
           "kind": KINDS}


def table_format(path: Path, fmt: str | None) -> TableFormat:
    """The given format, else the file's suffix (``.json``: json, anything else: csv)."""
    if fmt is not None:
        return "json" if fmt == "json" else "csv"
    return "json" if path.suffix.lower() == ".json" else "csv"


def read_rows(path: str | Path, fmt: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """(row number, non-empty cells) of every row: CSV lines (the header is line 1) or JSON rows (from 1)."""
    p = Path(path)
    if table_format(p, fmt) == "json":
        data = read_json(p)
        if isinstance(data, dict) and set(data) == {"rows"}:
            data = data["rows"]
        if not isinstance(data, list):
            raise SpecError([Problem(str(p), "", "expected a JSON list of row objects (or {\"rows\": [...]})")])
        out = []
        for i, row in enumerate(data, start=1):
            if not isinstance(row, dict):
                raise SpecError([Problem(f"{p}:{i}", "", f"expected a row object, got {type(row).__name__}")])
            out.append((i, {str(k): v for k, v in row.items() if v is not None and v != ""}))
        return out
    reader = csv.reader(io.StringIO(read_text(p), newline=""))
    try:
        header = next(reader)
    except StopIteration:
        raise SpecError([Problem(str(p), "", "empty table (expected a header row)")]) from None
    except csv.Error as exc:
        raise SpecError([Problem(f"{p}:1", "", f"malformed CSV: {exc}")]) from None
    header = [h.strip() for h in header]
    unknown = [h for h in header if h not in COLUMNS]
    if unknown:
        raise SpecError([Problem(f"{p}:1", h, f"unknown column (expected some of: {', '.join(COLUMNS)})")
                         for h in unknown])
    twice = sorted({h for h in header if header.count(h) > 1})
    if twice:   # the row dicts would keep the last of the two cells, silently
        raise SpecError([Problem(f"{p}:1", h, "column given twice") for h in twice])
    rows = []
    try:
        for cells in reader:
            line = reader.line_num
            if not any(c.strip() for c in cells):
                continue
            if len(cells) > len(header):
                raise SpecError([Problem(f"{p}:{line}", "", f"{len(cells)} cells for {len(header)} columns")])
            rows.append((line, {h: c.strip() for h, c in zip(header, cells) if c.strip()}))
    except csv.Error as exc:
        raise SpecError([Problem(f"{p}:{reader.line_num}", "", f"malformed CSV: {exc}")]) from None
    return rows


def _cell(where: str, name: str, value: Any, problems: list[Problem]) -> Any:
    """One cell converted and checked (CSV cells are text, JSON ones numbers or text); None if bad."""
    if name not in INTS and name not in FLOATS:
        if value not in CHOICES[name]:
            problems.append(Problem(where, name, f"expected one of {', '.join(CHOICES[name])}, got {value!r}"))
            return None
        return value
    kind, convert = ("an integer", int) if name in INTS else ("a number", float)
    raw = value
    if isinstance(value, str):
        try:
            value = convert(value) if number_text_problem(value) is None else None  # int() reads "１２", "1_0"
        except ValueError:
            value = None
    wrong_type = isinstance(value, bool) or not isinstance(value, int if convert is int else (int, float))
    if wrong_type or isinstance(value, float) and not math.isfinite(value):
        problems.append(Problem(where, name, f"expected {kind}, got {raw!r}"))
        return None
    # The spec files' bounds (runtime/torchfree/spec/schema.py): a JSON integer of 400 digits overflowed math.isfinite
    # (a traceback), and 1e300 seconds were imported as measured.
    if abs(value) > (MAX_INT if name in INTS else MAX_FLOAT):
        shown = repr(raw) if len(repr(raw)) <= 40 else repr(raw)[:37] + "..."
        problems.append(Problem(where, name, f"{shown} is out of range (at most "
                                             f"{f'{MAX_INT:,}' if name in INTS else f'{MAX_FLOAT:g}'} in size)"))
        return None
    if name in INTS and value < INTS[name]:
        problems.append(Problem(where, name, f"must be at least {INTS[name]}, got {value}"))
        return None
    if name in FLOATS and (value < 0 or (name == "bandwidth_gbs" and value == 0)):
        problems.append(Problem(where, name, f"must be {'positive' if name == 'bandwidth_gbs' else 'non-negative'}"
                                             f", got {value}"))
        return None
    # bandwidth_gbs is a link curve's point (link and allreduce rows): bounded per message by LinkCurve
    why = figure_problem(name, value, floor=name != "bandwidth_gbs") if name in FLOATS else None
    if why is not None:
        problems.append(Problem(where, name, why))
        return None
    return convert(value)


@dataclass
class _Parsed:
    """The rows sorted into what a profile holds."""

    # (layer or None, tp, component) -> {(micro_batch, seq_len): (forward_s, backward_s)}; optimizer seconds
    compute: dict[tuple[int | None, int, str], dict[tuple[int, int], tuple[float, float]]] = field(default_factory=dict)
    optimizer: dict[tuple[int | None, int, str], float] = field(default_factory=dict)
    links: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)
    allreduce: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)
    iteration_s: float = 0.0


def parse_rows(rows: Sequence[tuple[int, Mapping[str, Any]]], file: str) -> _Parsed:
    """Check every row and sort the measurements; all problems raised at once (one per bad field)."""
    problems: list[Problem] = []
    out = _Parsed()
    seen: dict[tuple, int] = {}
    optimizer_row: dict[tuple[int | None, int, str], int] = {}
    for n, cells in rows:
        where = f"{file}:{n}"
        kind = _cell(where, "kind", cells.get("kind"), problems) if "kind" in cells else None
        if kind is None:
            if "kind" not in cells:
                problems.append(Problem(where, "kind", f"missing (expected one of {', '.join(KINDS)})"))
            continue
        required, optional = FIELDS[kind]
        bad = len(problems)
        problems += [Problem(where, name, f"not used on a {kind} row") for name in cells
                     if name != "kind" and name not in required + optional]
        problems += [Problem(where, name, f"missing (a {kind} row needs {', '.join(required)})") for name in required
                     if name not in cells]
        v = {name: _cell(where, name, cells[name], problems) for name in required + optional if name in cells}
        if len(problems) > bad:
            continue
        if kind == "compute":
            layer = v.get("layer")
            if v["component"] == LAYER_ROW and "optimizer_s" in v:
                problems.append(Problem(where, "optimizer_s", "not used on a whole-layer row (the optimizer step is "
                                                              "per component: give it on component rows)"))
                continue
            if layer is not None and v["component"] not in (*LAYER_COMPONENTS, LAYER_ROW):
                problems.append(Problem(where, "component", f"a per-layer row overrides one of "
                                                            f"{', '.join(LAYER_COMPONENTS)}, got {v['component']!r}"))
                continue
            if layer is not None and "optimizer_s" in v:
                problems.append(Problem(where, "optimizer_s", "not used on a per-layer row (the optimizer step is "
                                                              "per component and TP degree)"))
                continue
            key, point = (layer, v["tp"], v["component"]), (v["micro_batch"], v["seq_len"])
            dup = ("compute", key, point)
            if dup in seen:
                problems.append(Problem(where, "seq_len", f"duplicate of row {seen[dup]} (same component, layer, tp, "
                                                          "micro_batch and seq_len)"))
                continue
            seen[dup] = n
            out.compute.setdefault(key, {})[point] = (v["forward_s"], v["backward_s"])
            if "optimizer_s" in v:
                if key in out.optimizer and out.optimizer[key] != v["optimizer_s"]:
                    problems.append(Problem(where, "optimizer_s", f"{v['optimizer_s']} differs from row "
                                                                  f"{optimizer_row[key]} ({out.optimizer[key]}): one "
                                                                  "step per component and TP degree"))
                    continue
                out.optimizer[key], optimizer_row[key] = v["optimizer_s"], optimizer_row.get(key, n)
        elif kind in ("link", "allreduce"):
            sub = v["direction"] if kind == "link" else v["group"]
            dup = (kind, v["link"], sub, v["bytes"])
            if dup in seen:
                problems.append(Problem(where, "bytes", f"duplicate of row {seen[dup]}"))
                continue
            seen[dup] = n
            why = curve_point_problem(v["bytes"], v["bandwidth_gbs"], last=False)  # the curve's rule, at its row
            if why is not None:
                problems.append(Problem(where, "bandwidth_gbs", why))
                continue
            target = out.links if kind == "link" else out.allreduce
            target.setdefault((v["link"], sub), {})[v["bytes"]] = v["bandwidth_gbs"]  # type: ignore[index]
        else:
            if "iteration" in seen:
                problems.append(Problem(where, "seconds", f"duplicate of row {seen['iteration']} (one fixed "
                                                          "cost per iteration)"))
                continue
            seen["iteration"] = n
            out.iteration_s = v["seconds"]
    for kind, curves in (("link", out.links), ("allreduce", out.allreduce)):
        for (cls, sub), points in curves.items():  # the largest message's rate prices every larger one
            top = max(points)
            why = curve_point_problem(top, points[top], last=True)
            if why is not None:
                problems.append(Problem(f"{file}:{seen[kind, cls, sub, top]}", "bandwidth_gbs", why))
    if problems:
        raise SpecError(problems)
    return out


def _grid(file: str, key: tuple[int | None, int, str], points: Mapping[tuple[int, int], tuple[float, float]],
          optimizer_s: float | None) -> ComponentTable:
    layer, tp, comp = key
    mbs = tuple(sorted({b for b, _ in points}))
    lens = tuple(sorted({s for _, s in points}))
    missing = [(b, s) for b in mbs for s in lens if (b, s) not in points]
    if missing:
        what = f"{comp} at tp {tp}" + (f", layer {layer}" if layer is not None else "")
        shown = ", ".join(f"micro_batch {b} x seq_len {s}" for b, s in missing[:3])
        raise SpecError([Problem(file, what, f"missing {shown}{' ...' if len(missing) > 3 else ''} (a table "
                                             "needs every combination of its micro-batch sizes and sequence lengths)")])
    return ComponentTable(mbs, lens, tuple(tuple(points[b, s][0] for s in lens) for b in mbs),
                          tuple(tuple(points[b, s][1] for s in lens) for b in mbs), optimizer_s)


def _curve(points: Mapping[int, float], file: str, what: str) -> LinkCurve:
    sizes = tuple(sorted(points))
    try:
        return LinkCurve(sizes, tuple(points[b] for b in sizes))
    except FieldErrors as err:  # a point's message time (LinkCurve): said with the rows' own names
        raise SpecError([Problem(file, what, m) for _, m in err.problems]) from None


def import_profile(path: str | Path, *, device_type: str, model: ModelSpec, base: DeviceProfile,
                   fmt: str | None = None, includes_tp_comm: bool = False,
                   serialised_send_recv: bool = False, base_name: str | None = None) -> DeviceProfile:
    """A ``provenance: imported`` profile of ``device_type``: ``base``'s figures (a spec profile: memory,
    throughput, link latencies) with the table's measurements for ``model``'s shape."""
    file = str(path)
    rows = read_rows(path, fmt)
    if not rows:   # a header alone wrote the base profile back as 'imported', measuring nothing
        raise SpecError([Problem(file, "", "no rows: the table measures nothing to import")])
    parsed = parse_rows(rows, file)
    tables: dict[int, dict[str, ComponentTable]] = {}
    layers: dict[int, dict[int, dict[str, ComponentTable]]] = {}
    order = (*COMPONENTS, LAYER_ROW)
    for key in sorted(parsed.compute, key=lambda k: (k[0] is not None, k[0] or 0, k[1], order.index(k[2]))):
        layer, tp, comp = key
        grid = _grid(file, key, parsed.compute[key], parsed.optimizer.get(key))
        target = tables.setdefault(tp, {}) if layer is None else layers.setdefault(layer, {}).setdefault(tp, {})
        if comp != LAYER_ROW:
            target[comp] = grid
            continue
        both = [c for c in LAYER_COMPONENTS if (layer, tp, c) in parsed.compute]
        if both:
            where = f"tp {tp}" + (f", layer {layer}" if layer is not None else "")
            raise SpecError([Problem(file, f"compute ({where})", f"whole-layer rows and {', '.join(both)} rows: give "
                                     "the layer whole or by its components, not both")])
        target.update(split_layer_table(grid, model, base.compute, tp))   # the documented split (layer_rows.py)
    models = dict(base.models)
    if tables or layers:
        if not tables:
            raise SpecError([Problem(file, "compute", "per-layer rows need the shared rows of the same components "
                                                      "(rows without a layer)")])
        mbs = sorted({b for t in tables.values() for c in t.values() for b in c.micro_batches})
        lens = tuple(sorted({s for t in tables.values() for c in t.values() for s in c.seq_lens}))
        models = {k: m for k, m in models.items() if not m.matches(model)}
        models[model.name] = MeasuredModel(
            hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size, num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads, vocab_size=model.vocab_size, micro_batch=mbs[0], seq_lens=lens, tp={},
            tables=tables, layers=layers, includes_tp_comm=includes_tp_comm, architecture=model.architecture)
    links: dict[str, LinkCurves] = {}
    for cls in ("intra", "inter"):
        send, recv = parsed.links.get((cls, "send")), parsed.links.get((cls, "recv"))
        if send or recv:
            links[cls] = LinkCurves(send=_curve(send, file, f"link {cls} send") if send else None,
                                    recv=_curve(recv, file, f"link {cls} recv") if recv else None)
    allreduce: dict[str, dict[int, LinkCurve]] = {}
    for (cls, n), points in sorted(parsed.allreduce.items()):
        allreduce.setdefault(cls, {})[n] = _curve(points, file, f"allreduce {cls} group {n}")
    comm = dataclasses.replace(base.comm, links=links or base.comm.links,
                               allreduce_curves=allreduce or base.comm.allreduce_curves,
                               serialised_send_recv=serialised_send_recv)
    source = dataclasses.replace(base.source, note=f"imported from {Path(file).name}", host=None, torch_version=None,
                                 date=datetime.date.today().isoformat(), derived_from=base_name)
    return dataclasses.replace(base, device_type=device_type, provenance="imported", models=models, comm=comm,
                               iteration_s=parsed.iteration_s or base.iteration_s, source=source)


def table_rows(profile: DeviceProfile, model: str | None = None) -> list[dict[str, Any]]:
    """The flat rows of a profile (the inverse of ``import_profile`` for what a table holds): per model
    shape, its tables (or, without them, its fits evaluated at their measured points), per-layer rows,
    link and all-reduce curves, the fixed per-iteration cost. ``model``: which of the profile's models
    (by its key; needed when it has several)."""
    names = list(profile.models)
    if model is not None:
        if model not in profile.models:
            raise SpecError([Problem("", "--model", f"{model!r} is not among the profile's models "
                                                    f"({', '.join(names) or 'none'})")])
        names = [model]
    elif len(names) > 1:
        raise SpecError([Problem("", "--model", f"the profile holds several models ({', '.join(names)}): name one")])
    rows: list[dict[str, Any]] = []

    def compute_rows(layer: int | None, tp: int, comp: str, t: ComponentTable) -> None:
        for i, b in enumerate(t.micro_batches):
            for j, s in enumerate(t.seq_lens):
                row = {"kind": "compute", "component": comp, "layer": layer, "tp": tp, "micro_batch": b, "seq_len": s,
                       "forward_s": t.forward_s[i][j], "backward_s": t.backward_s[i][j], "optimizer_s": t.optimizer_s}
                rows.append({k: v for k, v in row.items() if v is not None})

    for name in names:
        m = profile.models[name]
        if m.tables:
            for tp, comps in m.tables.items():
                for comp, t in comps.items():
                    compute_rows(None, tp, comp, t)
        else:   # fits: at the points they were measured at
            for tp, fits in m.tp.items():
                for comp, fit in fits.items():
                    grid = tuple(tuple(eval_fit(f, m.micro_batch, s) for s in m.seq_lens)
                                 for f in (fit.forward_s, fit.backward_s))
                    compute_rows(None, tp, comp, ComponentTable((m.micro_batch,), m.seq_lens, (grid[0],), (grid[1],)))
        for layer, by_tp in m.layers.items():
            for tp, comps in by_tp.items():
                for comp, t in comps.items():
                    compute_rows(layer, tp, comp, t)
    for cls, curves in profile.comm.links.items():
        for direction, curve in (("send", curves.send), ("recv", curves.recv)):
            if curve is not None:
                rows += [{"kind": "link", "link": cls, "direction": direction, "bytes": b, "bandwidth_gbs": bw}
                         for b, bw in zip(curve.bytes, curve.bandwidth_gbs)]
    for cls, by_n in profile.comm.allreduce_curves.items():
        for n, curve in by_n.items():
            rows += [{"kind": "allreduce", "link": cls, "group": n, "bytes": b, "bandwidth_gbs": bw}
                     for b, bw in zip(curve.bytes, curve.bandwidth_gbs)]
    if profile.iteration_s > 0:
        rows.append({"kind": "iteration", "seconds": profile.iteration_s})
    return rows


def format_rows(rows: Sequence[Mapping[str, Any]], fmt: TableFormat) -> str:
    """CSV (every column, empty where a row has none; floats as Python's shortest exact repr) or JSON."""
    if fmt == "json":
        return json.dumps(list(rows), indent=1) + "\n"
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else repr(row[c]) if isinstance(row[c], float) else row[c]
                         for c in COLUMNS])
    return buf.getvalue()


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | Path, fmt: TableFormat) -> None:
    atomic_write_text(path, format_rows(rows, fmt))

"""Typed construction of frozen spec dataclasses from parsed YAML, and back.

One generic reader serves every spec: it walks the dataclass's type hints, reports unknown keys,
missing fields and wrong types with their full field path, then runs the class's own
``__post_init__`` validation and re-homes its problems under the same path.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from runtime.torchfree.errors import FieldErrors, Problem, SpecError, join_field

T = TypeVar("T")
# No figure of a spec is this large; beyond it products of a few figures overflow to inf (and inf - inf to
# nan), and integers lose exactness as floats and overflow index and seed sizes.
MAX_FLOAT = 1e30
MAX_INT = 2**53
# A figure in device units -- seconds, GiB, TFLOPS, GB/s: a field named ``*_s``, ``seconds*``, ``*_gib``,
# ``*tflops``, ``*_gbs`` -- beyond a million is no device, link or measurement (11.6 days for one op or
# latency, a PiB of memory, an exaFLOPS, a PB/s link): a unit slip, and a profile's 1e25 s forward or 1e30 GB/s
# link priced plans as nonsense. A positive capacity or rate below a millionth (a KiB, a MFLOPS, a KB/s link)
# is none either: a 1e-20 GB/s link priced one message at 1e15 s, beside which a micro-batch's 0.01 s vanished
# in rounding (hspmd plan spun). Times have no lower bound (a per-parameter optimizer cost is ~1e-11 s).
MAX_FIGURE = 1e6
MIN_FIGURE = 1e-6
UNITS = {"_s": "s", "_gib": "GiB", "tflops": "TFLOPS", "_gbs": "GB/s"}  # by the end of a field's name


@functools.cache
def unit_of(name: str) -> str | None:
    """The unit of a field called ``name`` (``UNITS``), None for a dimensionless one."""
    return "s" if name.startswith("seconds") else next((u for end, u in UNITS.items() if name.endswith(end)), None)


def figure_problem(name: str, value: float, *, floor: bool = True) -> str | None:
    """What is wrong with ``value`` for a field called ``name`` (its unit read off the name), None if fine.
    ``floor=False``: no lower bound (a link curve's points, whose class bounds each message's time instead:
    runtime/torchfree/profiling/tables.py ``curve_point_problem``; a field says so with ``metadata={"rate_by_size":
    True}``)."""
    unit = unit_of(name)
    if unit is not None and abs(value) > MAX_FIGURE:
        return f"{value:g} {unit} is beyond any device or measurement (at most {MAX_FIGURE:g} {unit})"
    if floor and unit not in (None, "s") and 0 < value < MIN_FIGURE:
        return f"{value:g} {unit} is below any device (at least {MIN_FIGURE:g} {unit})"
    return None


# Unicode categories that rewrite or reorder what a terminal shows: control (NUL, ESC, C1's CSI), format (the
# bidirectional overrides and isolates, zero-width characters), line and paragraph separators. The spec reader
# refuses them in names (``text_problem``); the CLI escapes them in whatever it prints (hetu_cli ``printable``).
UNPRINTABLE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def text_problem(text: str) -> str | None:
    """What is wrong with a name or text of a spec, None if fine: a control or format character (Unicode
    categories Cc, Cf, Zl, Zp: NUL, ESC, U+202E RIGHT-TO-LEFT OVERRIDE, the isolates U+2066-U+2069, a zero-width
    space) is printed in tables and error lines, where it rewrites or reorders what the user reads (a device
    type "\u202eA800" shows as "008A"), and no name or description needs one."""
    import unicodedata  # here: most strings are plain ASCII and never need the table

    if text.isascii() and text.isprintable():
        return None
    bad = next((ch for ch in text if unicodedata.category(ch) in UNPRINTABLE_CATEGORIES), None)
    if bad is None:
        return None
    name = unicodedata.name(bad, "a control character")
    return f"contains U+{ord(bad):04X} ({name}) at {text.index(bad)}: names and text are printed, write them " \
           "without control or format characters"


def number_text_problem(text: str) -> str | None:
    """What keeps ``text`` from being read as a number where ASCII digits are expected (command-line options,
    table cells), None if nothing: Python's int() and float() read any script's digits ("\uff11\uff12") and digit
    groups ("1_0" as 10), which a user who typed them did not mean (YAML files follow YAML 1.1, see docs/formats.md)."""
    if not text.isascii():
        return "ASCII digits only"
    if "_" in text:
        return "'_' is not a digit (int() would read 1_0 as 10)"
    return None


_MISSING = object()


class _Invalid(Exception):
    """Internal: this value could not be built; problems were already recorded."""


def build(cls: type[T], data: Any, file: str, path: str = "") -> T:
    """Build ``cls`` from plain data; raise SpecError listing every problem found."""
    problems: list[Problem] = []
    try:
        obj = _build(cls, data, file, path, problems)
    except _Invalid:
        obj = None
    if problems:
        raise SpecError(problems)
    return obj  # type: ignore[return-value]


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is tuple:
        return "a list"
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{text} ({type(value).__name__})"


def _build(tp: Any, data: Any, file: str, path: str, problems: list[Problem]) -> Any:
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = [a for a in get_args(tp) if a is not type(None)]
        if data is None:
            return None
        if len(args) == 1:
            return _build(args[0], data, file, path, problems)
        raise TypeError(f"unsupported union {tp}")  # pragma: no cover - schema bug
    if tp is Any:
        return data
    if tp is bool:
        if isinstance(data, bool):
            return data
    elif tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            if abs(data) > MAX_INT:
                problems.append(Problem(file, path, f"{data} is out of range (at most {MAX_INT:,} in size)"))
                raise _Invalid
            return data
    elif tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            if isinstance(data, int) and abs(data) > MAX_INT or not math.isfinite(float(data)):
                problems.append(Problem(file, path, f"expected a finite number, got {data!r}"))
                raise _Invalid
            if abs(data) > MAX_FLOAT:
                problems.append(Problem(file, path, f"{data:g} is out of range (at most {MAX_FLOAT:g} in size)"))
                raise _Invalid
            return float(data)
    elif tp is str:
        if isinstance(data, str):
            why = text_problem(data)
            if why is not None:
                problems.append(Problem(file, path, why))
                raise _Invalid
            return data
    elif origin is Literal:
        if data in get_args(tp) and type(data) in {type(a) for a in get_args(tp)}:
            return data
    elif origin is tuple:
        if isinstance(data, list):
            return _build_tuple(tp, data, file, path, problems)
    elif origin in (dict, collections.abc.Mapping):
        if isinstance(data, dict):
            key_t, val_t = get_args(tp)
            out = {}
            failed = False
            for k, v in data.items():
                sub = join_field(path, str(k))
                try:
                    out[_build(key_t, k, file, sub, problems)] = _build(val_t, v, file, sub, problems)
                except _Invalid:
                    failed = True
            if failed:
                raise _Invalid
            return out
    elif dataclasses.is_dataclass(tp):
        if isinstance(data, dict):
            return _build_dataclass(tp, data, file, path, problems)
    else:  # pragma: no cover - schema bug
        raise TypeError(f"unsupported field type {tp}")
    problems.append(Problem(file, path, f"expected {_type_name(tp)}, got {_describe(data)}"))
    raise _Invalid


def _build_tuple(tp: Any, data: list, file: str, path: str, problems: list[Problem]) -> tuple:
    args = get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        item_types = [args[0]] * len(data)
    else:
        if len(data) != len(args):
            problems.append(Problem(file, path, f"expected a list of {len(args)} items, got {len(data)}"))
            raise _Invalid
        item_types = list(args)
    out = []
    failed = False
    for i, (item_t, item) in enumerate(zip(item_types, data)):
        try:
            out.append(_build(item_t, item, file, f"{path}[{i}]", problems))
        except _Invalid:
            failed = True
    if failed:
        raise _Invalid
    return tuple(out)


@functools.cache
def _schema_of(cls: Any) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A dataclass's field types and init fields, once per class: the annotations are strings (``from
    __future__ import annotations``) that ``get_type_hints`` compiles anew on every call, a third of
    reading a plan (one call per stage and device object), and a start-up cost of every verb."""
    return get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls) if f.init}


def _build_dataclass(cls: Any, data: dict, file: str, path: str, problems: list[Problem]) -> Any:
    hints, fields = _schema_of(cls)
    failed = False
    for key in data:
        if key not in fields:
            problems.append(Problem(file, join_field(path, str(key)),
                                    f"unknown key (expected one of: {', '.join(fields)})"))
            failed = True
    kwargs = {}
    for name, f in fields.items():
        sub = join_field(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(Problem(file, sub, "missing required field"))
                failed = True
            continue
        try:
            kwargs[name] = _build_field(f, hints[name], data[name], file, sub, problems)
        except _Invalid:
            failed = True
    for name, value in kwargs.items():
        for at, v in _floats(value, join_field(path, name)) if unit_of(name) else ():
            why = figure_problem(name, v, floor=not fields[name].metadata.get("rate_by_size"))
            if why is not None:
                problems.append(Problem(file, at, why))
                failed = True
    if failed:
        raise _Invalid
    try:
        return cls(**kwargs)
    except FieldErrors as err:
        for f, m in err.problems:
            problems.append(Problem(file, join_field(path, f), m))
        raise _Invalid from None


def _floats(value: Any, path: str) -> list[tuple[str, float]]:
    """The numbers of a field's value (a number, or lists of them: fits, grids), each with its path."""
    if isinstance(value, tuple):
        return [x for i, v in enumerate(value) for x in _floats(v, f"{path}[{i}]")]
    return [(path, value)] if isinstance(value, float) else []


def _is_pair_form(f: dataclasses.Field, value: Any) -> bool:
    """A ``pair_or_list`` field (a tuple of pairs) given as one bare pair, e.g. ``layers: [0, 8]``."""
    return bool(f.metadata.get("pair_or_list")) and isinstance(value, (list, tuple)) and len(value) == 2 \
        and not any(isinstance(x, (list, tuple)) for x in value)


def _build_field(f: dataclasses.Field, tp: Any, data: Any, file: str, path: str, problems: list[Problem]) -> Any:
    if f.metadata.get("mapping_pairs") and data is not None:
        # A tuple of (key, value) pairs spelled as a mapping: read as one, the class makes it pairs. With
        # ``or_counts`` (naming what its keys are), a mapping of whole numbers instead (how many per key; the class
        # expands them).
        pairs = next(a for a in get_args(tp) if a is not type(None))
        key_t, val_t = get_args(get_args(pairs)[0])
        if f.metadata.get("or_counts") and isinstance(data, Mapping) and data:
            counts = [isinstance(v, int) and not isinstance(v, bool) for v in data.values()]
            if all(counts):
                val_t = int
            elif any(counts) and all(c or isinstance(v, list) for c, v in zip(counts, data.values())):
                key = f.metadata["or_counts"]   # what the keys are, for the message
                problems.append(Problem(file, path, f"give every {key} a list or every {key} a count, not both"))
                return None
        return _build(Mapping[key_t, val_t], data, file, path, problems)
    if _is_pair_form(f, data):
        # The pair is read at the field's own path: it is what the YAML spells there.
        return (_build(get_args(tp)[0], data, file, path, problems),)
    return _build(tp, data, file, path, problems)


def to_data(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) for YAML/JSON; ``None`` fields are omitted, and fields marked
    ``omit_default`` where they hold their default."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None or f.metadata.get("derived"):
                continue
            if f.metadata.get("omit_default") and value == f.default:
                continue  # an opt-in flag: plans that do not use it read as before
            if f.metadata.get("mapping_pairs"):
                value = dict(value)  # (key, value) pairs kept hashable, written as the mapping they were read as
            if f.metadata.get("pair_or_list") and len(value) == 1:
                value = value[0]  # written back in its one-item form, as it is usually written
            out[f.name] = to_data(value)
        return out
    if isinstance(obj, (tuple, list)):
        return [to_data(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_data(v) for k, v in obj.items()}
    return obj

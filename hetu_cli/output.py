"""Shared output helpers: rich consoles, JSON for scripts, and the error path (exit 2)."""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from runtime.torchfree.errors import HspmdError, Problem, SpecError
from runtime.torchfree.spec.schema import MAX_FLOAT, UNPRINTABLE_CATEGORIES, number_text_problem

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

class AsciiNumber(click.ParamType):
    """A number option that takes ASCII digits only, as YAML and JSON files do: Python's int() and float() read
    any script's digits (``--global-batch １２``, "١٢") and digit groups (``--global-batch 1_0`` as 10) as
    numbers (``number_text_problem``)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        why = number_text_problem(value) if isinstance(value, str) else None
        if why is not None:
            self.fail(f"{value!r} is not a number: {why}", param, ctx)
        return super().convert(value, param, ctx)


def int_list(text: str) -> list[int]:
    """'5,6' -> [5, 6] in ASCII digits (``number_text_problem``); ValueError for anything else, blanks skipped."""
    if number_text_problem(text) is not None:
        raise ValueError(text)
    return [int(x) for x in text.split(",") if x.strip()]


class Int(AsciiNumber, click.types.IntParamType):
    """``int`` of ASCII digits (AsciiNumber)."""


class IntRange(AsciiNumber, click.IntRange):
    """``click.IntRange`` of ASCII digits (AsciiNumber)."""


class FiniteFloatRange(AsciiNumber, click.FloatRange):
    """``click.FloatRange`` that also refuses nan, inf and figures beyond the specs' MAX_FLOAT. Click's range
    check lets nan through (every comparison with nan is false) and has no upper bound: ``replan --tolerance
    nan`` left no candidate within tolerance (a traceback), ``plan --time-limit nan`` planned as if unlimited."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv) or abs(rv) > MAX_FLOAT:
            self.fail(f"{value!r} is not a finite number of at most {MAX_FLOAT:g}", param, ctx)
        return rv


class MemoryMarginParam(click.ParamType):
    """``--memory-margin``: a fraction of each device's memory (0.1) or GiB per device (4GiB)."""

    name = "margin"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from planner.margin import MemoryMargin, parse_margin

        if isinstance(value, MemoryMargin):
            return value
        try:
            return parse_margin(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)


def memory_margin_option():
    """The ``--memory-margin`` option of the verbs that plan (a function: its default comes from the planner,
    which a verb that does not plan need not import)."""
    from planner.margin import DEFAULT_FRACTION

    return click.option("--memory-margin", "memory_margin", type=MemoryMarginParam(), default=str(DEFAULT_FRACTION),
                        show_default=True,
                        help="Memory every device keeps free beyond the modelled peak (allocator fragmentation, "
                             "communication buffers): a fraction of its memory (0.1) or GiB per device (4GiB); "
                             "0 packs to the modelled capacity (docs/planning.md).")


# Timeouts become ``datetime.timedelta``s (process groups, stores), which overflow past ~1e14 s: a
# ``--timeout 1e20`` crashed every worker. No run waits on one operation for more than ~115 days.
MAX_TIMEOUT_S = 1e7

FORMAT_OPTION = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text",
                             show_default=True, help="'json' prints one JSON object for scripts.")
PROFILE_OPTION = click.option("--profile", "profile_dirs", multiple=True, type=click.Path(path_type=Path),
                              help="Directory of device profiles (repeatable; before the shipped profiles/). "
                                   "A measured profile overrides a spec one.")


def console(stderr: bool = False) -> Console:
    # Imported here: rich's console costs ~25 ms of start-up that verbs printing one line need not pay.
    from rich.console import Console
    from rich.errors import MarkupError

    class Tolerant(Console):
        """Prints a line whose names from a file read as broken markup (a strategy named "[/red]": a
        MarkupError traceback in every verb that printed it) as it is, markup off; control and format
        characters escaped (``printable``)."""

        def render_str(self, text: str, **kw: Any) -> Any:
            text = printable(text)  # a path or name that would reorder or rewrite the terminal's line
            try:
                return super().render_str(text, **kw)
            except MarkupError:
                return super().render_str(text, **{**kw, "markup": False})

    # Pipes and CI logs get a wide fixed width rather than rich's 80 columns, so tables stay legible.
    width = None if (sys.stderr if stderr else sys.stdout).isatty() else 140
    return Tolerant(stderr=stderr, highlight=False, width=width)


def table(title: str, columns: Sequence[str], left: Collection[str] = ()) -> Table:
    """A left-titled table: figures right-aligned, the ``left`` columns (names, lists) left-aligned."""
    from rich.table import Table

    out = Table(title=title, title_justify="left")
    for col in columns:
        out.add_column(col, justify="left" if col in left else "right")
    return out


def emit_json(obj: Any) -> None:
    import json  # here, not at the top: a verb that prints no JSON does not pay for it at start-up

    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def printable(text: str) -> str:
    """``text`` with control and format characters (C0 but newline and tab, DEL, C1; Unicode's Cf, Zl, Zp: the
    bidirectional overrides U+202A-U+202E and isolates U+2066-U+2069, zero-width ones, U+2028) escaped: error
    lines and tables quote keys, values and paths the user gave, where YAML's "\\r", "\\b" or "\\x9b" (a
    terminal's CSI) rewrote the line on the user's terminal and U+202E showed "a800" as "008a". The spec
    reader refuses them in names (runtime/torchfree/spec/schema.py ``text_problem``); paths and keys of hostile files
    still reach here. (Messages of several lines keep their newlines.)"""
    if text.isascii() and text.isprintable():
        return text
    import unicodedata

    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) not in UNPRINTABLE_CATEGORIES
                   else ascii(ch)[1:-1] for ch in text)


def fail(error: HspmdError | str) -> NoReturn:
    """Print a user error, one problem per line, to stderr and exit with status 2."""
    lines = error.lines() if isinstance(error, HspmdError) else [error]
    for line in lines:
        # click.echo, not rich: field paths like stages[0] must not be read as markup.
        click.echo(f"error: {printable(line)}", err=True)
    sys.exit(2)


def given(*params: str) -> list[str]:
    """The options among ``params`` (click parameter names) that the command line set: a default is not
    "given", so a default-valued option never counts."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    return [name for name in params
            if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)]


def refuse_given(why: str, *params: str) -> None:
    """Refuse the options among ``params`` that the command line gave where they do not apply, one line each
    saying ``why``: accepted and then ignored, they would leave the user believing they took effect."""
    by_name = {p.name: p for p in click.get_current_context().command.params}
    problems = [Problem("/".join(o for o in (*by_name[name].opts, *by_name[name].secondary_opts)
                                 if o.startswith("--")), "", why) for name in given(*params)]
    if problems:
        raise SpecError(problems)


def plan_argument(help_text: str):
    """The plan a verb reads, as its first argument (``hspmd simulate plan.yaml``) or as ``--plan`` (the same
    path twice is fine; two different ones, or none, is a usage error). The verb receives ``plan_path``."""
    import functools

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args: Any, plan_arg: Path | None = None, plan_opt: Path | None = None, **kwargs: Any) -> Any:
            if plan_arg is not None and plan_opt is not None and plan_arg != plan_opt:
                raise click.UsageError(f"two plans given: PLAN {str(plan_arg)!r} and --plan {str(plan_opt)!r}")
            path = plan_arg if plan_arg is not None else plan_opt
            if path is None:
                raise click.UsageError("missing argument PLAN (the plan file; --plan PLAN also works)")
            return func(*args, plan_path=path, **kwargs)

        wrapper = click.option("--plan", "plan_opt", type=click.Path(path_type=Path), metavar="PLAN",
                               help=f"{help_text} (the same as the PLAN argument).")(wrapper)
        return click.argument("plan_arg", metavar="PLAN", required=False, type=click.Path(path_type=Path))(wrapper)

    return decorate

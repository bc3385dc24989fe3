"""User-facing errors. The CLI turns any ``HspmdError`` into its lines on stderr and exit code 2."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one field of one file."""

    file: str
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        if self.field:
            where += f"{self.field}: "
        return f"{where}{self.message}"


class HspmdError(Exception):
    """An error caused by the user's input or request, not by a bug: reported without traceback."""

    def lines(self) -> list[str]:
        return [str(self)]


MAX_REPORTED = 10  # problems shown per error; a hostile file must not fill the screen


class SpecError(HspmdError, ValueError):
    """One or more problems with a spec (cluster, model, plan, profile).

    ``problems`` keeps every one; ``lines()`` shows the first MAX_REPORTED and counts the rest.
    """

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        shown = [str(p) for p in self.problems[:MAX_REPORTED]]
        rest = self.problems[MAX_REPORTED:]
        if rest:
            files = sorted({p.file for p in rest if p.file})
            shown.append(str(Problem(", ".join(files), "", f"... and {len(rest)} more")))
        return shown


class InfeasibleError(HspmdError):
    """A well-formed request that cannot be satisfied (model does not fit, too few devices, ...)."""


class FieldErrors(ValueError):
    """Raised by ``__post_init__`` validators: problems relative to the object being built.

    The loader prefixes each relative field with the object's path; code that builds specs
    directly sees a plain ``ValueError`` listing every problem.
    """

    def __init__(self, problems: Iterable[tuple[str, str]]):
        self.problems: tuple[tuple[str, str], ...] = tuple(problems)
        super().__init__("; ".join(f"{f}: {m}" if f else m for f, m in self.problems))


class Checker:
    """Collects (field, message) pairs in a ``__post_init__`` and raises them all at once, as ``FieldErrors``
    when its ``with`` block ends."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def check(self, ok: bool, field: str, message: str) -> bool:
        if not ok:
            self.problems.append((field, message))
        return ok

    def add(self, field: str, message: str) -> None:
        self.problems.append((field, message))

    def each(self, obj: object, names: Iterable[str], ok: Callable[[Any], bool], message: str) -> None:
        """``check`` each named attribute of ``obj``; the message gets the bad value appended."""
        for name in names:
            self.check(ok(getattr(obj, name)), name, f"{message}, got {getattr(obj, name)}")

    def __enter__(self) -> Checker:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        """``with Checker() as c:`` raises what the block collected when it ends (not over its exception)."""
        if exc_type is None and self.problems:
            raise FieldErrors(self.problems)


def join_field(prefix: str, field: str) -> str:
    if not prefix:
        return field
    if not field:
        return prefix
    if field.startswith("["):
        return prefix + field
    return f"{prefix}.{field}"


def listed(values: Sequence[object], limit: int = 12) -> str:
    """``values`` for a one-line message: all of them, or the first ``limit`` and how many there are."""
    items = list(values)
    if len(items) <= limit:
        return str(items)
    return "[" + ", ".join(str(v) for v in items[:limit]) + f", ... ({len(items)} in all)]"

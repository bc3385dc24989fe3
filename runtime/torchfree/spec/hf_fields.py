"""Typed access to the keys of a Hugging Face ``config.json``: one problem per bad field, collected."""

from __future__ import annotations

from typing import Any

from runtime.torchfree.errors import Problem
from runtime.torchfree.spec.schema import MAX_FLOAT, MAX_INT


class Fields:
    """Typed access to config keys, collecting one problem per bad field."""

    def __init__(self, data: dict[str, Any], file: str) -> None:
        self.data, self.file = data, file
        self.problems: list[Problem] = []

    def bad(self, field: str, message: str) -> None:
        self.problems.append(Problem(self.file, field, message))

    def get_int(self, key: str, default: int | None = None, *, required: bool = False,
                source: dict[str, Any] | None = None, prefix: str = "") -> int | None:
        value = (self.data if source is None else source).get(key)
        if value is None:
            if required:
                self.bad(prefix + key, "missing required field")
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            self.bad(prefix + key, f"expected an integer, got {repr(value)[:40]}")
            return default
        if abs(value) > MAX_INT:  # the YAML specs' bound: 10**400 overflowed float division (a traceback)
            self.bad(prefix + key, f"an integer of {len(str(abs(value)))} digits is out of range (at most "
                                   f"{MAX_INT:,})")
            return default
        return value

    def get_float(self, key: str, default: float, source: dict[str, Any] | None = None, prefix: str = "") -> float:
        value = (self.data if source is None else source).get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not abs(value) <= MAX_FLOAT:
            self.bad(prefix + key, f"expected a finite number of at most {MAX_FLOAT:g}, got {str(value)[:40]}")
            return default
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.bad(key, f"expected true or false, got {value!r}")
            return default
        return value

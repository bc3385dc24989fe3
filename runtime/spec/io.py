"""Reading and writing spec files: strict YAML in, deterministic YAML out, atomic writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from runtime.errors import Problem, SpecError


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML file with ``safe_load``; missing files and syntax errors become a SpecError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([Problem(str(p), "", "file not found")]) from None
    except IsADirectoryError:
        raise SpecError([Problem(str(p), "", "is a directory, expected a YAML file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem(str(p), "", f"cannot read: {exc}")]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError([Problem(str(p), where, f"malformed YAML: {what}")]) from None


def dump_yaml(data: Any) -> str:
    """Deterministic block YAML with inline lists of scalars (``layers: [0, 3]``)."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) so that readers see either the old file or the whole new one."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would have.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise

"""The repository states what is: no development history in any tracked file.

Milestone numbers, tracker issue numbers and the development machines' paths say how the code came to be,
not what it does; git keeps that. Every tracked file is scanned (binary files aside), this one included,
so the patterns below are written so that they do not match their own source text.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PATTERNS = {
    "a milestone number": re.compile(r"\bs[t]ops?\s+\d+|\bmiles[t]ones?\s+\d+|\bM[0-9]{1,2}\b(?![-.]\d)", re.I),
    "a tracker issue number": re.compile(r"\biss[u]es?\s+#?\d+|\bPR\s+#\d+", re.I),
    "a development machine's path": re.compile(r"/wor[k]/(?:main|wt|shared|bench)\b"),
}
IGNORED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "demo-out"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        return [REPO / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):   # not a git checkout: every file of the tree
        return [p for p in REPO.rglob("*") if p.is_file() and not IGNORED_DIRS & set(p.relative_to(REPO).parts)]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError:   # deleted in the work tree, still in the index
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def findings(name: str, text: str) -> list[str]:
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        for what, pattern in PATTERNS.items():
            m = pattern.search(line)
            if m:
                out.append(f"{name}:{lineno}: {what} ({m.group(0)!r})")
    return out


@pytest.mark.parametrize("sample", ["measured at st" "op 22's main", "St" "ops 31", "before M" "3",
                                    "see iss" "ue 12", "in /wo" "rk/wt/docs"])
def test_the_patterns_catch_history(sample: str) -> None:
    assert findings("sample", sample), f"no pattern catches {sample!r}"


@pytest.mark.parametrize("sample", ["the loop stops when every device is idle", "a 35M-parameter model",
                                    "issues are listed one line each", "stop at the first plan",
                                    "M = 4 micro-batches", "/work/ is not ours"])
def test_the_patterns_leave_plain_text_alone(sample: str) -> None:
    assert findings("sample", sample) == []


def test_no_development_history_in_tracked_files() -> None:
    files = tracked_files()
    assert len(files) > 50, "the file list is empty: nothing was scanned"
    problems = []
    for path in files:
        text = text_of(path)
        if text is not None:
            problems += findings(str(path.relative_to(REPO)), text)
    assert problems == [], "development history in the repository:\n" + "\n".join(problems)

"""The user-facing docs name only options the commands have and files the repository has.

Users copy the docs' commands literally; a renamed flag or a moved module must fail here, not there.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from hetu_cli.main import cli

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/formats.md", "docs/planning.md", "docs/training.md", "docs/failures.md",
        "docs/lengths.md", "docs/profiles.md", "docs/schedules.md", "docs/design.md", "docs/benchmarks.md",
        "profiles/README.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
COMMAND = re.compile(r"(?:\bhspmd|-m hetu_cli)\s+([a-z][a-z-]*)((?:\s+(?:import|export|show|prepare)\b)?)(.*)", re.S)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
VERBS = set(cli.list_commands(click.Context(cli)))
REPO_PATH = re.compile(r"(?<![\w./-])((?:runtime|planner|hetu_cli|scripts|tests|configs|profiles|docs)/[\w.*<>/-]*)")


def code_texts(doc: str) -> list[str]:
    """Every fenced block's commands (continuation lines joined, comments dropped) and every inline span."""
    text = (REPO / doc).read_text()
    out: list[str] = []
    for block in FENCE.findall(text):
        lines: list[str] = []
        for line in block.splitlines():
            line = line.split("#", 1)[0].rstrip().removesuffix("\\")
            if lines and line[:1].isspace():   # an indented line continues the command above it
                lines[-1] += " " + line.strip()
            elif line:
                lines.append(line)
        out += lines
    out += INLINE.findall(FENCE.sub("", text))
    return out


def commands(doc: str) -> list[tuple[str, str, str]]:
    """(verb, subcommand or "", the rest of the command) for every hspmd command the doc shows."""
    found = []
    for code in code_texts(doc):
        for i, part in enumerate(re.split(r"(?=\bhspmd\s|-m hetu_cli\s)", code)):
            m = COMMAND.match(part.strip())
            # Prose inside a span ("newer than this hspmd reads") is not a command unless it starts the span.
            if m and (m.group(1) in VERBS or i <= 1 and code.lstrip().startswith(("hspmd ", "torchrun "))):
                found.append((m.group(1), m.group(2).strip(), m.group(3)))
    return found


def options_of(verb: str, sub: str) -> set[str] | None:
    ctx = click.Context(cli)
    cmd = cli.get_command(ctx, verb)
    if cmd is None:
        return None
    if sub:
        assert isinstance(cmd, click.Group)
        cmd = cmd.get_command(ctx, sub)
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_option_exists(doc: str) -> None:
    shown = commands(doc)
    problems = []
    for verb, sub, rest in shown:
        opts = options_of(verb, sub)
        if opts is None:
            problems.append(f"hspmd {verb}: no such command")
            continue
        problems += [f"hspmd {' '.join(filter(None, (verb, sub)))}: {flag}" for flag in FLAG.findall(rest)
                     if flag not in opts]
    assert problems == [], f"{doc} shows options the commands do not have: {sorted(set(problems))}"


def test_the_docs_show_commands() -> None:
    """The parser finds the docs' commands at all (else the test above checks nothing)."""
    verbs = {verb for doc in DOCS for verb, _sub, _rest in commands(doc)}
    assert {"plan", "train", "simulate", "profile", "replan", "show", "export", "agent", "check-numerics"} <= verbs


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_repository_path_exists(doc: str) -> None:
    missing = []
    for code in code_texts(doc):
        code = re.sub(r"(?:--out|-o)\s+\S+", "", code)   # what a command writes need not exist yet
        for ref in REPO_PATH.findall(code):
            ref = ref.rstrip(".").replace("<", "*").replace(">", "")
            ref = re.sub(r"\*[\w-]*\*", "*", ref)
            if not (list(REPO.glob(ref)) if "*" in ref else (REPO / ref).exists()):
                missing.append(ref)
    assert missing == [], f"{doc} names paths the repository lacks: {missing}"

"""Hostile files through every verb that reads one: random bytes, truncations and mutations of each
shipped file. Whatever the file, a verb exits 0 (the mutation stayed valid) or 2 with a few lines, each
naming the file when the file itself is at fault; never a traceback, never exit 1, never over 5 s of CPU,
and nothing written when it fails.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetu_cli.main import cli
from runtime.torchfree.errors import MAX_REPORTED, SpecError
from runtime.torchfree.profiling.profile import load_profile
from runtime.torchfree.spec import load_cluster, load_model, load_plan

REPO = Path(__file__).resolve().parents[3]
PLANS = sorted((REPO / "configs" / "plans").glob("*.yaml"))
MODELS = sorted((REPO / "configs" / "models").glob("*.yaml"))
CLUSTERS = sorted((REPO / "configs" / "clusters").glob("*.yaml"))
PROFILES = sorted((REPO / "profiles").glob("*.yaml"))
TINY_PLAN = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
SECONDS = 5.0  # of CPU per verb run
HANG_SECONDS = 60.0  # of wall time: a hang, whatever the load
MAX_LINES = MAX_REPORTED + 2  # the capped list, its "... and N more", and slack for one usage line
EXAMPLES = 40  # per verb and file kind: ~60 s in all on a loaded 2-core box (~20 s of CPU)

# Byte values a mutation prefers: the ones that change YAML structure or numbers.
SIGNIFICANT = b":-[]{}&*!|>#'\"\n \t,?%@`0123456789.eE"


@st.composite
def mutated(draw, original: bytes) -> bytes:
    """One hostile variant of a file: random bytes, a truncation, byte edits, line edits, or a known
    hostile shape (deep nesting, alias bomb, future version, duplicate key, huge or odd numbers)."""
    kind = draw(st.sampled_from(["random", "truncate", "bytes", "lines", "shape"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "truncate":
        return original[:draw(st.integers(0, max(len(original) - 1, 0)))]
    if kind == "bytes":
        data = bytearray(original)
        for _ in range(draw(st.integers(1, 8))):
            pos = draw(st.integers(0, len(data)))
            byte = draw(st.one_of(st.sampled_from(list(SIGNIFICANT)), st.integers(0, 255)))
            op = draw(st.sampled_from(["replace", "insert", "delete"]))
            if op == "insert" or pos == len(data):
                data.insert(pos, byte)
            elif op == "replace":
                data[pos] = byte
            else:
                del data[pos]
        return bytes(data)
    lines = original.split(b"\n")
    if kind == "lines":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(lines) - 1))
            op = draw(st.sampled_from(["drop", "duplicate", "swap", "indent", "dedent"]))
            if op == "drop" and len(lines) > 1:
                del lines[i]
            elif op == "duplicate":
                lines.insert(i, lines[i])
            elif op == "swap":
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            elif op == "indent":
                lines[i] = b"  " + lines[i]
            else:
                lines[i] = lines[i].lstrip()
        return b"\n".join(lines)
    shape = draw(st.sampled_from(["deep", "bomb", "version", "number", "anchor"]))
    if shape == "deep":
        n = draw(st.integers(65, 5000))
        return b"version: 1\nx: " + b"[" * n + b"]" * n + b"\n" + original
    if shape == "bomb":
        levels = [b'a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x"]']
        levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 8)}]".encode() for i in range(1, 8)]
        return b"\n".join(levels) + b"\n" + original
    if shape == "version":
        v = draw(st.sampled_from([b"999", b"0", b"-1", b"1.5", b"'1'", b"null", b"[1]", b"9" * 5000]))
        return original.replace(b"version: 1", b"version: " + v)
    if shape == "number":
        digits = [i for i, c in enumerate(original) if chr(c).isdigit()]
        if not digits:
            return original
        pos = draw(st.sampled_from(digits))
        value = draw(st.sampled_from([b"0", b"-3", b"1e400", b".nan", b"-.inf", b"0x7fffffffffffffffff",
                                      b"999999999999", b"9" * 30, b"9" * 5000, b"1.0e-30", b"1.0e+30", b"2.5",
                                      b"true", b"~"]))
        return original[:pos] + value + original[pos + 1:]
    # anchor: make the whole document reuse itself under a new key (valid YAML, unknown key).
    return b"base: &base\n" + b"\n".join(b"  " + line for line in lines) + b"\nagain: *base\n"


@dataclass(frozen=True)
class Verb:
    """How one verb reads a file of one kind: its argv, given the hostile file, a scratch directory and
    the output path it must not write on failure."""

    name: str
    argv: Callable[[Path, Path, Path], list[str]]
    # Some verbs stop with exit 2 right after their up-front validation when every file is fine
    # (so that a fuzz run never starts training or profiling); their message starts like this.
    stop: str | None = None
    # The verb does real work on a valid file (the planner searches): fuzz it on the small cluster's files
    # only, so that a mutation that stays valid also finishes within the time bound.
    small_only: bool = False


def plan_referencing(scratch: Path, *, model: Path | None = None, cluster: Path | None = None) -> Path:
    """A copy of the tiny plan that reads the hostile model or cluster file by path."""
    text = TINY_PLAN.read_text()
    if model is not None:
        text = text.replace("model: llama-tiny", f"model: {model}")
    if cluster is not None:
        text = text.replace("cluster: cpu-hetero4", f"cluster: {cluster}")
    p = scratch / "uses.yaml"
    p.write_text(text)
    return p


MISSING_DATA = "/nonexistent/hspmd-fuzz/data.txt"
PLAN_VERBS = [
    Verb("validate", lambda f, s, o: ["validate", str(f)]),
    Verb("show", lambda f, s, o: ["show", str(f)]),
    Verb("show --device", lambda f, s, o: ["show", str(f), "--device", "0", "--format", "json"]),
    Verb("simulate", lambda f, s, o: ["simulate", "--plan", str(f), "--trace", str(o)]),
    Verb("replan", lambda f, s, o: ["replan", "--plan", str(f), "--failed", "0", "--time-limit", "1", "-o", str(o)],
         small_only=True),
    Verb("train", lambda f, s, o: ["train", "--plan", str(f), "--metrics", str(o), "--data", MISSING_DATA],
         stop=f"error: {MISSING_DATA}: --data: file not found"),
]
MODEL_VERBS = [
    Verb("validate", lambda f, s, o: ["validate", str(plan_referencing(s, model=f))]),
    Verb("plan", lambda f, s, o: ["plan", "--model", str(f), "--cluster", "cpu-hetero4", "--global-batch", "8",
                                  "--seq-len", "16", "--time-limit", "1", "--check-top", "0", "-o", str(o)]),
    Verb("profile", lambda f, s, o: ["profile", "--cluster", "cpu-hetero4", "--model", str(f), "--seq-lens", "1",
                                     "--out", str(o)], stop="error: Invalid value for --seq-lens"),
]
CLUSTER_VERBS = [
    Verb("validate --cluster", lambda f, s, o: ["validate", str(TINY_PLAN), "--cluster", str(f)]),
    Verb("show", lambda f, s, o: ["show", str(plan_referencing(s, cluster=f))]),
    Verb("simulate --cluster", lambda f, s, o: ["simulate", "--plan", str(TINY_PLAN), "--cluster", str(f),
                                                "--trace", str(o)]),
    Verb("plan", lambda f, s, o: ["plan", "--model", "llama-tiny", "--cluster", str(f), "--global-batch", "8",
                                  "--seq-len", "16", "--time-limit", "1", "--check-top", "0", "-o", str(o)]),
    Verb("profile", lambda f, s, o: ["profile", "--cluster", str(f), "--seq-lens", "1", "--out", str(o)],
         stop="error: Invalid value for --seq-lens"),
]
PROFILE_VERBS = [
    Verb("simulate --profile", lambda f, s, o: ["simulate", "--plan", str(TINY_PLAN), "--profile", str(f.parent),
                                                "--trace", str(o)]),
    Verb("plan --profile", lambda f, s, o: ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4",
                                            "--profile", str(f.parent), "--global-batch", "8", "--seq-len", "16",
                                            "--time-limit", "1", "--check-top", "0", "-o", str(o)]),
]


class TooSlow(Exception):
    pass


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (rather than hang the suite) if a verb runs past twice the allowed time."""
    def fire(signum, frame):
        raise TooSlow(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def file_is_bad(loader: Callable[[Path], object], path: Path) -> bool:
    try:
        loader(path)
    except SpecError:
        return True
    return False


def check(verb: Verb, original: Path, data: bytes, loader: Callable[[Path], object]) -> tuple[int, str]:
    scratch = Path(tempfile.mkdtemp(prefix="hspmd-fuzz-"))
    try:
        hostile = scratch / "in" / original.name
        hostile.parent.mkdir()
        hostile.write_bytes(data)
        out = scratch / "out" / "written"
        argv = verb.argv(hostile, scratch, out)
        # CPU time, not wall time: the verb runs in this process, and on a shared 2-core box the wall
        # clock measures the other jobs too. The wall deadline only catches a hang.
        t0 = time.process_time()
        with deadline(HANG_SECONDS):
            result = CliRunner().invoke(cli, argv)
        elapsed = time.process_time() - t0
        text = result.output
        where = f"{verb.name} on a variant of {original.name}: exit {result.exit_code}\n{text}"
        assert "Traceback" not in text, where
        assert result.exit_code in (0, 2), where
        if result.exit_code != 0:
            assert isinstance(result.exception, SystemExit), f"{where}\n{result.exception!r}"
        assert elapsed < SECONDS, f"{where}\ntook {elapsed:.1f} s of CPU"
        bad = file_is_bad(loader, hostile)
        if bad:
            assert result.exit_code == 2, where
        if result.exit_code == 2:
            assert not out.exists(), f"{where}\nwrote {out}"
            lines = [line for line in text.splitlines() if line.strip()]
            assert 1 <= len(lines) <= MAX_LINES, where
            if bad:
                assert all(str(hostile) in line for line in lines), where
            else:
                # Every file read fine on its own; the verb may still refuse the combination.
                assert all(line.startswith(("error: ", "Error: ", "Usage: ", "Try ")) for line in lines), where
        return result.exit_code, text
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_fuzz(verbs: list[Verb], files: list[Path], loader: Callable[[Path], object]):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.sampled_from(verbs),
           st.sampled_from(files).flatmap(lambda f: st.tuples(st.just(f), mutated(f.read_bytes()))))
    def fuzz(verb: Verb, case: tuple[Path, bytes]) -> None:
        original, data = case
        check(verb, original, data, loader)

    fuzz()


@pytest.mark.parametrize("verb", PLAN_VERBS, ids=lambda v: v.name)
def test_hostile_plans(verb):
    run_fuzz([verb], [p for p in PLANS if p.name.startswith("cpu-")] if verb.small_only else PLANS, load_plan)


@pytest.mark.parametrize("verb", MODEL_VERBS, ids=lambda v: v.name)
def test_hostile_models(verb):
    run_fuzz([verb], MODELS, lambda p: load_model(str(p)))


@pytest.mark.parametrize("verb", CLUSTER_VERBS, ids=lambda v: v.name)
def test_hostile_clusters(verb):
    run_fuzz([verb], CLUSTERS, lambda p: load_cluster(str(p)))


@pytest.mark.parametrize("verb", PROFILE_VERBS, ids=lambda v: v.name)
def test_hostile_profiles(verb):
    run_fuzz([verb], PROFILES, load_profile)


def test_shipped_files_pass_every_verb():
    """The unmutated files are fine: the fuzz's exit-0 branch is real, not vacuous."""
    cases = ((PLAN_VERBS, PLANS, load_plan), (MODEL_VERBS, [REPO / "configs" / "models" / "llama-tiny.yaml"], None),
             (CLUSTER_VERBS, [REPO / "configs" / "clusters" / "cpu-hetero4.yaml"], None),
             (PROFILE_VERBS, PROFILES, load_profile))
    for verbs, files, loader in cases:
        for verb in verbs:
            for f in files[:2]:
                code, text = check(verb, f, f.read_bytes(), loader or (lambda p: None))
                if verb.stop is None:
                    assert code == 0, f"{verb.name} {f.name}: {text}"
                else:
                    assert code == 2 and verb.stop in text, f"{verb.name} {f.name}: {text}"

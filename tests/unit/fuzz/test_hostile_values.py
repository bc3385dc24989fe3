"""Well-formed files with hostile values, through every verb that reads them. test_hostile_files.py mutates
bytes; this walks the fields: each shipped (or built-in example) file of every kind a verb reads -- plan,
cluster, model YAML, Hugging Face config.json, profile, failure trace (``--events``), length histogram
(``--lengths``), profile import table (CSV and JSON) -- with one field set to 0, -1, 1e308, -0.0, nan, inf,
10**30, 2.5, a bool, a string, null, an empty list or mapping, a list; one key deleted; or one list entry
duplicated. A deterministic sample of those per verb, plus the inputs that once broke a verb (regressions).

Whatever the value: exit 0 or 2, never a traceback or exit 1, within the time bound, nothing written on
exit 2, a few lines; when the file alone is at fault (its loader refuses it), every line names the file and
the problems name a field under the mutated key's top-level key.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from test_hostile_files import MAX_LINES, MISSING_DATA, REPO, TINY_PLAN, deadline, plan_referencing

from hetu_cli.main import cli
from runtime.documents import load_histogram
from runtime.elastic.events import load_trace
from runtime.torchfree.errors import SpecError
from runtime.torchfree.profiling.flat_table import COLUMNS
from runtime.torchfree.profiling.profile import load_profile
from runtime.torchfree.spec import load_cluster, load_model, load_plan
from runtime.torchfree.spec.hf import config_for

SECONDS = 10.0
SAMPLES = 10  # mutations per (kind, verb); the regressions come on top
FEWER = {"plan --cluster": 4, "plan --profile": 6}  # verbs that search (~1 s a run on a loaded box)
HOSTILE: tuple[Any, ...] = (0, -1, 1e308, -0.0, float("nan"), float("inf"), float("-inf"), 10**30, 2.5, True,
                            "x", None, [], {}, [1, 2])
Path_ = tuple[Any, ...]  # a field path inside the parsed file: keys and list indices

EVENTS = {"steps": 30, "events": [{"step": 10, "action": "kill", "devices": [3]},
                                  {"step": 20, "action": "rejoin", "node": "cpu0"}]}
HISTOGRAM = {"scale": "tokens", "bins": [{"lo": 8, "hi": 32, "weight": 3}, {"lo": 33, "hi": 64, "weight": 1}]}
TABLE = ",".join(COLUMNS) + """
compute,attention,,1,1,2048,0.00121,0.00265,0.00031,,,,,,
compute,attention,,1,1,4096,0.00262,0.00581,0.00031,,,,,,
compute,attention,,1,2,2048,0.00229,0.00502,0.00031,,,,,,
compute,attention,,1,2,4096,0.00498,0.01104,0.00031,,,,,,
link,,,,,,,,,inter,send,,4096,0.5,
link,,,,,,,,,inter,send,,16777216,11.5,
allreduce,,,,,,,,,inter,,8,67108864,10.0,
iteration,,,,,,,,,,,,,,0.0031
"""


def table_rows() -> list[dict[str, Any]]:
    rows = []
    for r in csv.DictReader(io.StringIO(TABLE)):
        rows.append({k: yaml.safe_load(v) for k, v in r.items() if v != ""})
    return rows


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def dump_csv(rows: Any) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow(["" if r.get(c) is None else str(r[c]) for c in COLUMNS] if isinstance(r, dict) else [str(r)])
    return buf.getvalue()


@dataclass(frozen=True)
class Kind:
    """One file kind: its example files, how to write one, the loader that judges it alone, its verbs."""

    name: str
    examples: Callable[[], list[tuple[str, Any]]]
    dump: Callable[[Any], str]
    loader: Callable[[Path], object] | None
    verbs: dict[str, Callable[[Path, Path, Path], list[str]]]


def yaml_files(folder: Path, names: tuple[str, ...]) -> Callable[[], list[tuple[str, Any]]]:
    return lambda: [(n, yaml.safe_load((folder / n).read_text())) for n in names]


def tiny_cluster_running() -> tuple[Any, tuple[int, ...]]:
    plan = load_plan(TINY_PLAN)
    return load_cluster("cpu-hetero4"), plan.strategies[0].devices


PLAN_ARGS = ["--global-batch", "8", "--seq-len", "16", "--time-limit", "1", "--check-top", "0"]
KINDS = {k.name: k for k in [
    Kind("plan", yaml_files(REPO / "configs" / "plans", ("cpu-hetero4-tiny.yaml", "cpu-hetero4-dp-pp.yaml",
                                                          "h800-h20-llama32b.yaml")),
         dump_yaml, load_plan, {
             "validate": lambda h, s, o: ["validate", str(h)],
             "show": lambda h, s, o: ["show", str(h), "--format", "json"],
             "show --device": lambda h, s, o: ["show", str(h), "--device", "0", "--format", "json"],
             "simulate": lambda h, s, o: ["simulate", "--plan", str(h), "--trace", str(o)],
             "train": lambda h, s, o: ["train", "--plan", str(h), "--metrics", str(o), "--data", MISSING_DATA],
         }),
    Kind("cluster", yaml_files(REPO / "configs" / "clusters", ("cpu-hetero4.yaml", "h800-h20-48.yaml")),
         dump_yaml, lambda p: load_cluster(str(p)), {
             "validate --cluster": lambda h, s, o: ["validate", str(TINY_PLAN), "--cluster", str(h)],
             "simulate --cluster": lambda h, s, o: ["simulate", "--plan", str(TINY_PLAN), "--cluster", str(h),
                                                    "--trace", str(o)],
             "plan --cluster": lambda h, s, o: ["plan", "--model", "llama-tiny", "--cluster", str(h), *PLAN_ARGS,
                                                "-o", str(o)],
         }),
    Kind("model", yaml_files(REPO / "configs" / "models", ("llama-tiny.yaml",)), dump_yaml,
         lambda p: load_model(str(p)), {
             "validate": lambda h, s, o: ["validate", str(plan_referencing(s, model=h))],
             "profile import --model": lambda h, s, o: ["profile", "import", str(s / "table.csv"), "--type",
                                                        "chip-a", "--model", str(h), "--out", str(o)],
         }),
    Kind("config.json", lambda: [("config.json", config_for(load_model("llama-tiny"), "float32"))], json.dumps,
         lambda p: load_model(str(p)), {
             "validate": lambda h, s, o: ["validate", str(plan_referencing(s, model=h))],
         }),
    Kind("profile", yaml_files(REPO / "profiles", ("chip-a.yaml", "RTX4090.yaml")), dump_yaml, load_profile, {
        "profile show": lambda h, s, o: ["profile", "show", str(h)],
        "simulate --profile": lambda h, s, o: ["simulate", "--plan", str(TINY_PLAN), "--profile", str(h.parent),
                                               "--trace", str(o)],
    }),
    # A profile of a type cpu-hetero4 runs (chip-a's figures), so that its values reach the cost model.
    Kind("used profile", lambda: [("cpu-fast.yaml", {**yaml.safe_load((REPO / "profiles" / "chip-a.yaml").read_text()),
                                                     "device_type": "cpu-fast"})], dump_yaml, load_profile, {
        "plan --profile": lambda h, s, o: ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--profile",
                                           str(h.parent), *PLAN_ARGS, "-o", str(o)],
        "simulate --profile": lambda h, s, o: ["simulate", "--plan", str(TINY_PLAN), "--profile", str(h.parent),
                                               "--trace", str(o)],
    }),
    Kind("events", lambda: [("events.yaml", EVENTS)], dump_yaml,
         lambda p: load_trace(p, *tiny_cluster_running()), {
             "train --events": lambda h, s, o: ["train", "--plan", str(TINY_PLAN), "--elastic", "--events", str(h),
                                                "--steps", "30", "--metrics", str(o), "--data", MISSING_DATA],
         }),
    Kind("lengths", lambda: [("lengths.yaml", HISTOGRAM)], dump_yaml, lambda p: load_histogram(p, 64), {
        "simulate --lengths": lambda h, s, o: ["simulate", "--plan", str(TINY_PLAN), "--lengths", str(h),
                                               "--steps", "2", "--tokens-per-step", "256", "--trace", str(o)],
    }),
    Kind("table.csv", lambda: [("table.csv", table_rows())], dump_csv, None, {
        "profile import": lambda h, s, o: ["profile", "import", str(h), "--type", "chip-a", "--model",
                                           "llama-tiny", "--format", "csv", "--out", str(o)],
    }),
    Kind("table.json", lambda: [("table.json", table_rows())], json.dumps, None, {
        "profile import": lambda h, s, o: ["profile", "import", str(h), "--type", "chip-a", "--model",
                                           "llama-tiny", "--format", "json", "--out", str(o)],
    }),
]}


def nodes(data: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    yield path, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        yield from nodes(v, path + (k,))


def parent(data: Any, path: Path_) -> Any:
    for p in path[:-1]:
        data = data[p]
    return data


def variants(data: Any) -> list[tuple[str, Path_, Any]]:
    """Every (description, path, mutated copy): each field set to each hostile value, deleted, and each
    list's last entry duplicated."""
    out = []
    for path, value in list(nodes(data))[1:]:
        container = isinstance(value, (dict, list))
        for h in ([], {}, None, 0, "x") if container else HOSTILE:
            d = copy.deepcopy(data)
            parent(d, path)[path[-1]] = copy.deepcopy(h)
            out.append((f"{dotted(path)} = {h!r}", path, d))
        if isinstance(value, list) and value:
            d = copy.deepcopy(data)
            parent(d, path)[path[-1]].append(copy.deepcopy(value[-1]))
            out.append((f"{dotted(path)}: last entry twice", path, d))
        d = copy.deepcopy(data)
        del parent(d, path)[path[-1]]
        out.append((f"{dotted(path)} deleted", path, d))
    return out


def dotted(path: Path_) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def with_value(data: Any, path: Path_, value: Any) -> Any:
    d = copy.deepcopy(data)
    parent(d, path)[path[-1]] = value
    return d


def loader_problems(kind: Kind, path: Path) -> tuple | None:
    if kind.loader is None:
        return None
    try:
        kind.loader(path)
    except SpecError as err:
        return err.problems
    return None


def check(kind: Kind, verb: str, name: str, text: str, mutated: Path_, what: str) -> str | None:
    """Run one verb on one hostile file; what is wrong with the outcome (None: fine)."""
    scratch = Path(tempfile.mkdtemp(prefix="hspmd-values-"))
    try:
        (scratch / "table.csv").write_text(TABLE)
        hostile = scratch / "in" / name
        hostile.parent.mkdir()
        hostile.write_text(text)
        out = scratch / "out" / "written"
        t0 = time.perf_counter()
        with deadline(2 * SECONDS):
            result = CliRunner().invoke(cli, kind.verbs[verb](hostile, scratch, out))
        elapsed = time.perf_counter() - t0
        where = f"{verb} on {name} with {what}: exit {result.exit_code}\n{result.output}"
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            return f"{where}\n{result.exception!r}"
        if "Traceback" in result.output or result.exit_code not in (0, 2):
            return where
        if elapsed > SECONDS:
            return f"{where}\ntook {elapsed:.1f} s"
        if result.exit_code != 2:
            return None
        if out.exists():
            return f"{where}\nwrote {out}"
        lines = [line for line in result.output.splitlines() if line.strip()]
        if not 1 <= len(lines) <= MAX_LINES:
            return f"{where}\n{len(lines)} lines"
        problems = loader_problems(kind, hostile)
        if problems:
            if not all(str(hostile) in line for line in lines):
                return f"{where}\na line does not name {hostile}"
            if mutated and not any(p.field.split(".")[0].split("[")[0] == str(mutated[0]) or
                                   (isinstance(mutated[0], int) and p.field.startswith(f"[{mutated[0]}]")) or
                                   not p.field for p in problems):
                return f"{where}\nno problem names a field under {mutated[0]!r}: {[p.field for p in problems]}"
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Inputs that once broke a verb: (kind, verb, example index, {path: value}); the first path is the one
# whose field the message must name.
REGRESSIONS: list[tuple[str, str, int, dict[Path_, Any]]] = [
    ("events", "train --events", 0, {("events", 1, "node"): [1, 2]}),      # TypeError: unhashable list
    ("events", "train --events", 0, {("events", 1, "node"): {}}),
    ("config.json", "validate", 0, {("model_type",): [1, 2]}),             # TypeError: unhashable list
    ("config.json", "validate", 0, {("hidden_size",): 10**400}),           # OverflowError dividing it
    ("config.json", "validate", 0, {("rope_theta",): 10**400}),            # OverflowError: float()
    ("used profile", "plan --profile", 0, {("compute", "kernel_overhead_s"): 1e308}),  # PulpError: inf
    ("cluster", "plan --cluster", 0, {("device_types", "cpu-fast", "memory_gib"): 1e308}),  # ValueError: nan
    ("cluster", "plan --cluster", 0, {("device_types", "cpu-fast", "intra_node_bandwidth_gbs"): 1e-20}),  # a hang
    ("lengths", "simulate --lengths", 0, {("bins", 0, "hi"): 10**30}),    # OverflowError splitting
    ("lengths", "simulate --lengths", 0, {("bins", 0, "lo"): True}),       # true read as 1
    ("lengths", "simulate --lengths", 0, {("bins", 0, "weight"): 10**400}),  # OverflowError in isfinite
    # A consistent billion-sequence step: every schedule listed a billion micro-batches (a hang).
    ("plan", "simulate", 0, {("training", "global_batch"): 10**9,
                             ("strategies", 0, "pipelines", 0, "micro_batches"): 10**9 - 2}),
    ("plan", "show --device", 0, {("training", "global_batch"): 10**9,
                                  ("strategies", 0, "pipelines", 0, "micro_batches"): 10**9 - 2}),
]


def cases(kind: Kind, verb: str) -> list[tuple[str, Path_, str, str]]:
    """(file name, mutated path, description, text): a seeded sample of the variants, then regressions."""
    rng = random.Random(f"{kind.name}/{verb}")
    examples = kind.examples()
    pool = [(name, path, desc, d) for name, data in examples for desc, path, d in variants(data)]
    sample = rng.sample(pool, min(FEWER.get(verb, SAMPLES), len(pool)))
    picked = [(n, p, desc, kind.dump(d)) for n, p, desc, d in sample]
    for k, v, i, edits in REGRESSIONS:
        if (k, v) == (kind.name, verb):
            name, data = examples[i]
            for path, value in edits.items():
                data = with_value(data, path, value)
            picked.append((name, next(iter(edits)), ", ".join(f"{dotted(p)} = {x!r}" for p, x in edits.items())
                           + " (regression)", kind.dump(data)))
    return picked


VERBS = [(k, v) for k in KINDS.values() for v in k.verbs]


@pytest.mark.parametrize("kind,verb", VERBS, ids=[f"{k.name}:{v}" for k, v in VERBS])
def test_hostile_values(kind: Kind, verb: str) -> None:
    failures = [f for name, path, what, text in cases(kind, verb)
                if (f := check(kind, verb, name, text, path, what)) is not None]
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("kind,verb", VERBS, ids=[f"{k.name}:{v}" for k, v in VERBS])
def test_examples_pass(kind: Kind, verb: str) -> None:
    """The unmutated examples are accepted (or stop at the verb's deliberate missing --data), so the
    mutations above start from valid files and an exit 0 among them is real."""
    for name, data in kind.examples()[:1]:
        scratch = Path(tempfile.mkdtemp(prefix="hspmd-values-"))
        try:
            (scratch / "table.csv").write_text(TABLE)
            f = scratch / "in" / name
            f.parent.mkdir()
            f.write_text(kind.dump(data))
            result = CliRunner().invoke(cli, kind.verbs[verb](f, scratch, scratch / "out"))
            if MISSING_DATA in " ".join(kind.verbs[verb](f, scratch, scratch / "out")):
                assert result.exit_code == 2 and f"{MISSING_DATA}: --data: file not found" in result.output, \
                    result.output
            else:
                assert result.exit_code == 0, f"{verb} {name}: {result.output}"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


INFEASIBLE = [
    # (argv, what the message must say)
    (["plan", "--model", "llama-70b", "--cluster", "cpu-hetero4", "--global-batch", "8", "--seq-len", "64"],
     ("does not fit", "use a smaller model or devices with more memory")),
    (["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "1", "--seq-len", "64",
      "--elastic"], ("at least 2 pipelines", "at least 2 sequences")),
    (["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "3", "--micro-batch", "2",
      "--seq-len", "64"], ("does not divide",)),
    (["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", str(10**9), "--seq-len",
      "64"], ("at most 65,536",)),
    (["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8", "--seq-len",
      "100000"], ("exceeds", "max_seq_len 256")),
]


@pytest.mark.parametrize("argv,says", INFEASIBLE, ids=lambda x: "-" if isinstance(x, tuple) else None)
def test_infeasible_requests_say_why(argv: list[str], says: tuple[str, ...], tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    with deadline(2 * SECONDS):
        result = CliRunner().invoke(cli, [*argv, "--time-limit", "1", "--check-top", "0", "-o", str(out)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and not out.exists()
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and all(s in lines[0] for s in says), result.output


# ``hspmd train --data FILE.jsonl``: lines whose ``text`` is hostile. Only refused ones (a valid file would
# start training): each stops before any worker starts, naming FILE:LINE and the field.
BAD_LINES = [
    ('{"text": "a\\ud800b"}', "text: not valid Unicode"),   # a lone surrogate: UnicodeEncodeError once
    ('{"text": 5}', "text: expected a string"),
    ('{"text": null}', "text: expected a string"),
    ('{"txt": "a"}', "text: missing"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": [1e308]}', "text: expected a string"),
]


@pytest.mark.parametrize("line,says", BAD_LINES)
def test_hostile_data_lines(line: str, says: str, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n' + line + "\n")
    out = tmp_path / "metrics.jsonl"
    with deadline(2 * SECONDS):
        result = CliRunner().invoke(cli, ["train", "--plan", str(TINY_PLAN), "--data", str(data), "--steps", "1",
                                          "--metrics", str(out)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert lines == [lines[0]] and f"{data}:2: {says}" in lines[0], result.output
    assert not out.exists()


# Counts given on the command line: refused at once (exit 2, one error line), never enumerated.
TINY = str(TINY_PLAN)
EXTREME_COUNTS = [
    ["simulate", "--plan", TINY, "--lengths", "uniform", "--tokens-per-step", "256", "--steps", str(10**9)],
    ["simulate", "--plan", TINY, "--lengths", "uniform", "--tokens-per-step", str(10**9), "--steps", "2"],
    ["replan", "--plan", TINY, "--failed", str(10**22), "--time-limit", "1"],
    ["show", TINY, "--device", str(10**22)],
]


@pytest.mark.parametrize("argv", EXTREME_COUNTS, ids=lambda a: " ".join(a[i] for i in (0, -2)))
def test_extreme_counts_are_refused(argv: list[str]) -> None:
    with deadline(2 * SECONDS):
        result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.startswith(("error: ", "Error: "))]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output

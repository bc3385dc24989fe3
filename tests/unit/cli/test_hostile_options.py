"""Hostile values of command-line options: refused at once (exit 2, one error line, nothing written),
never a traceback, never planned with."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hetu_cli.main import COMMANDS, cli
from hetu_cli.output import FiniteFloatRange

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml")
PLAN_TINY = ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8", "--seq-len", "16",
             "--check-top", "0"]
MISSING_DATA = "/nonexistent/hspmd-options/data.txt"


def every_command() -> list[tuple[str, click.Command]]:
    ctx = click.Context(cli)
    out = []
    for name in COMMANDS:
        cmd = cli.get_command(ctx, name)
        assert cmd is not None
        out.append((name, cmd))
        if isinstance(cmd, click.Group):
            out.extend((f"{name} {sub}", cmd.get_command(ctx, sub)) for sub in cmd.list_commands(ctx))
    return out


def test_every_float_option_refuses_non_finite_values():
    """Click's FloatRange lets nan through its range check (and inf through a lower bound): every float
    option of every verb uses FiniteFloatRange, the ones added later too."""
    plain = [f"{name} {'/'.join(p.opts)}" for name, cmd in every_command() for p in cmd.params
             if isinstance(p.type, click.types.FloatParamType) and not isinstance(p.type, FiniteFloatRange)]
    assert not plain, plain


def test_every_number_option_refuses_digits_of_other_scripts():
    """int() and float() read "１２" (full-width) and "١٢" (Arabic-Indic) as 12: every int and float option of
    every verb, the ones added later too, takes ASCII digits only, as the YAML and JSON files do."""
    ctx = click.Context(cli)
    took = []
    for name, cmd in every_command():
        for p in cmd.params:
            if isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType)):
                for text in ("\uff11\uff12", "\u0661\u0662"):
                    try:
                        took.append((name, p.opts, text, p.type.convert(text, p, ctx)))
                    except click.BadParameter as err:
                        assert "ASCII digits only" in err.format_message()
    assert not took, took


@pytest.mark.parametrize("args", [
    ["replan", "--plan", TINY, "--failed", "0", "--time-limit", "1", "--tolerance", "nan"],   # once a traceback
    ["replan", "--plan", TINY, "--failed", "0", "--time-limit", "1", "--storage-gbs", "inf"],
    ["replan", "--plan", TINY, "--failed", "0", "--time-limit", "1", "--restart-s", "1e400"],
    [*PLAN_TINY, "--time-limit", "nan"],                                                     # once planned
    [*PLAN_TINY, "--time-limit", "inf"],
    ["train", "--plan", TINY, "--timeout", "1e20", "--data", MISSING_DATA],  # overflowed timedelta in the workers
    ["train", "--plan", TINY, "--heartbeat-timeout", "nan", "--data", MISSING_DATA],
    ["agent", "--coordinator", "127.0.0.1:1", "--node", "n", "--token", "t", "--timeout", "inf"],
    ["profile", "--cluster", "cpu-hetero4", "--budget", "nan", "--out", "OUT"],
    ["profile", "--cluster", "cpu-hetero4", "--budget", "1e29", "--out", "OUT"],  # timed one point for ever
], ids=lambda a: " ".join(a[i] for i in (0, -2, -1)))
def test_non_finite_floats_are_refused(args: list[str], tmp_path: Path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    result = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "p.yaml")] if args[0] in ("plan", "replan")
                                else args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.startswith(("error: ", "Error: "))]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert "is not a finite number" in errors[0] or "is not in the range" in errors[0], result.output
    assert not any(tmp_path.iterdir())


def output_cases(table: str = ""):
    """Every verb option that writes a file, as argv given the output path (``table``: an import table)."""
    return {
        "plan -o": lambda o: [*PLAN_TINY, "--time-limit", "1", "-o", o],
        "plan --symmetric-out": lambda o: [*PLAN_TINY, "--time-limit", "1", "--symmetric-out", o],
        "replan -o": lambda o: ["replan", "--plan", TINY, "--failed", "3", "--time-limit", "1", "-o", o],
        "simulate --trace": lambda o: ["simulate", "--plan", TINY, "--trace", o],
        "profile import --out": lambda o: ["profile", "import", table, "--type", "chip-a", "--model", "llama-tiny",
                                           "--out", o],
        "profile export --out": lambda o: ["profile", "export", "chip-a", "--out", o],
    }


UNWRITABLE = {
    "a directory": (lambda d: d / "adir", "is a directory, expected a file name"),
    "under a file": (lambda d: d / "afile" / "x.out", "cannot write: Not a directory"),
    "a name too long": (lambda d: d / ("x" * 300), "cannot write: File name too long"),
    "deep and too long": (lambda d: d.joinpath("new", *["y" * 200] * 30, "x.out"), "cannot write: File name too long"),
}


@pytest.mark.parametrize("what", list(UNWRITABLE))
@pytest.mark.parametrize("verb", list(output_cases()))
def test_unwritable_outputs_are_refused_before_any_work(verb: str, what: str, tmp_path: Path):
    """Each once raised OSError (a traceback) after the work was done, or left the first of two outputs."""
    from runtime.torchfree.profiling.flat_table import format_rows, table_rows
    from runtime.torchfree.profiling.profile import load_profile

    table = tmp_path / "afile"   # chip-a's own table: fine to import, and a file to write under
    table.write_text(format_rows(table_rows(load_profile(REPO / "profiles" / "chip-a.yaml"), None), "csv"))
    (tmp_path / "adir").mkdir()
    where, says = UNWRITABLE[what]
    out = where(tmp_path)
    args = output_cases(str(table))[verb](str(out))
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {out}: ") and says in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert not any((tmp_path / "adir").iterdir())


def test_a_write_that_fails_leaves_nothing(tmp_path: Path):
    """Where only the write finds out (a pseudo file system, a full disk): one line, and neither of two outputs
    nor a directory created for them is left."""
    from runtime.torchfree.errors import SpecError
    from runtime.torchfree.spec.io import atomic_write_files

    first = tmp_path / "new" / "deeper" / "plan.yaml"
    with pytest.raises(SpecError) as err:
        atomic_write_files([(first, b"a"), (Path("/proc/hspmd-test/x.yaml"), b"b")])
    assert [str(p) for p in err.value.problems] == ["/proc/hspmd-test/x.yaml: cannot write: No such file or directory"]
    assert not any(tmp_path.iterdir())


LONG = "x" * 300   # a file name longer than any file system's 255 bytes: ENAMETOOLONG, not ENOENT


def long_path_cases(d: Path) -> dict[str, tuple[list[str], str]]:
    """argv given a path no file can have, and what the one error line must name."""
    long = str(d / LONG)
    deep = str(d.joinpath(*["y" * 200] * 30))   # past PATH_MAX
    plan = d / "plan.yaml"
    plan.write_text(Path(TINY).read_text().replace("model: llama-tiny", f"model: {long}"))
    cluster = d / "cluster.yaml"
    cluster.write_text((REPO / "configs" / "clusters" / "cpu-hetero4-sleep.yaml").read_text()
                       .replace("profile: A800", f"profile: {long}.yaml"))
    return {
        "validate PLAN": (["validate", long], long),
        "validate deep PLAN": (["validate", deep], deep),
        "plan's model:": (["validate", str(plan)], f"{plan}: model: unknown model"),
        "validate --cluster": (["validate", TINY, "--cluster", long], "--cluster: unknown cluster"),
        "emulate target profile": (["validate", TINY, "--cluster", str(cluster)],
                                   f"{cluster}: device_types.emu-a800.emulate.target.profile: unknown device profile"),
        "plan --model": ([*PLAN_TINY, "--model", long], "--model: unknown model"),
        "simulate --lengths": (["simulate", "--plan", TINY, "--lengths", long, "--tokens-per-step", "256"], long),
        "simulate --profile": (["simulate", "--plan", TINY, "--profile", long], long),
        "simulate --events": (["simulate", "--plan", TINY, "--events", long], long),
        "profile show": (["profile", "show", deep], "no profile"),
        "profile import --base": (["profile", "import", TINY, "--type", "chip-a", "--model", "llama-tiny",
                                   "--base", long, "--out", str(d / "p.yaml")], "--base: no profile"),
        "export --checkpoint": (["export", "--checkpoint", long, "--out", str(d / "e")], long),
        "export --out": (["export", "--checkpoint", str(d), "--out", long], long),
        "train --save": (["train", "--plan", TINY, "--save", long], long),
        "train --switch": (["train", "--plan", TINY, "--switch", f"2:{long}"], long),
    }


LONG_CASES = ["validate PLAN", "validate deep PLAN", "plan's model:", "validate --cluster", "emulate target profile",
              "plan --model", "simulate --lengths", "simulate --profile", "simulate --events", "profile show",
              "profile import --base", "export --checkpoint", "export --out", "train --save", "train --switch"]


@pytest.mark.parametrize("case", LONG_CASES)
def test_paths_no_file_can_have_are_one_line(case: str, tmp_path: Path):
    """Python 3.11's pathlib raises ENAMETOOLONG from is_file/is_dir/exists: each of these was a traceback
    (train --save passed its up-front check and would have failed only at the end of the run)."""
    cases = long_path_cases(tmp_path)
    assert sorted(cases) == sorted(LONG_CASES)
    args, names = cases[case]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    errors = [line for line in result.output.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith("error: ") and names in errors[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml", "plan.yaml"]


def test_an_os_error_on_a_path_is_one_line(monkeypatch):
    """The backstop: an OS error on a user's path that no check met first (e.g. a directory the user may not
    read, which root, who runs these tests, always may) is one line naming the path, exit 2."""
    import hetu_cli.commands.validate as validate

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/some/where/plan.yaml")

    monkeypatch.setattr(validate, "load_plan_context", denied)
    result = CliRunner().invoke(cli, ["validate", TINY])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.splitlines() == ["error: /some/where/plan.yaml: Permission denied"]


@pytest.mark.parametrize("type_name", ["", "TRAVERSE/outside", "\\x"])
def test_profile_import_type_is_a_file_name(type_name: str, tmp_path: Path):
    """--type names the default output, profiles/<type>.imported.yaml: '../../outside' would write
    outside.imported.yaml outside the checkout. (Here a traversal would land in tmp_path.)"""
    type_name = type_name.replace("TRAVERSE", "../" * 40 + str(tmp_path).lstrip("/"))
    table = tmp_path / "t.csv"
    table.write_text("kind\n")
    result = CliRunner().invoke(cli, ["profile", "import", str(table), "--type", type_name, "--model", "llama-tiny",
                                      "--base", "chip-a"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --type: "), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]


def test_max_strategies_is_bounded(tmp_path: Path):
    """--max-strategies 10**9 looped a billion (empty) combinations of candidate strategies: a hang."""
    out = tmp_path / "p.yaml"
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--lengths",
                                      "longtail", "--tokens-per-step", "256", "--max-strategies", str(10**9),
                                      "--time-limit", "1", "-o", str(out)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "'--max-strategies': 1000000000 is not in the range 1<=x<=8" in result.output and not out.exists()


def test_control_characters_in_an_error_line_are_escaped(tmp_path: Path):
    """A key quoted from a hostile file reached the terminal raw: "\\r", "\\b", ESC or the C1 CSI (0x9b) could
    rewrite or hide the error line."""
    plan = tmp_path / "plan.yaml"
    plan.write_text('version: 1\n"a\\rb\\bc\\ed\\x9be\\x07": 1\n')
    result = CliRunner().invoke(cli, ["validate", str(plan)])
    assert result.exit_code == 2, result.output
    first = result.output.splitlines()[0]
    assert first == (f"error: {plan}: a\\rb\\x08c\\x1bd\\x9be\\x07: unknown key (expected one of: version, model, "
                     "cluster, training, strategies, profiles)"), result.output
    assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in result.output.replace("\n", ""))

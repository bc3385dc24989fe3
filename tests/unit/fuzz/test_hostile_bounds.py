"""Hostile inputs the earlier passes left open: absurd but finite figures in profiles and profile tables,
digits of other scripts where a number is expected, an empty ``--strategy``, and long failure traces of
legitimate, repeated events. Each is refused with one line naming the file (or option) and the field, exit 2,
nothing written; or, for the trace, modelled in bounded time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from test_hostile_files import REPO, TINY_PLAN, deadline
from test_hostile_values import TABLE

from hetu_cli.main import cli

CHIP_A = yaml.safe_load((REPO / "profiles" / "chip-a.yaml").read_text())


def one_error(result: Any) -> str:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error: ", "Error: "))]
    assert len(errors) == 1, result.output
    return errors[0]


# A figure in device units beyond a million (seconds, GiB, TFLOPS, GB/s), or a rate below a millionth, was
# read as measured (the specs' only bound was 1e30): plans priced at 1e25 s per op, or a link at 1e-30 GB/s.
ABSURD_PROFILE = [
    (("compute", "kernel_overhead_s"), 1e25, "1e+25 s is beyond"),
    (("compute", "memory_bandwidth_gbs"), 1e-30, "1e-30 GB/s is below"),
    (("compute", "memory_bandwidth_gbs"), 1e30, "1e+30 GB/s is beyond"),
    (("compute", "peak_tflops"), 1e29, "TFLOPS is beyond"),
    (("memory_gib",), 1e9, "1e+09 GiB is beyond"),
    (("memory", "framework_overhead_gib"), 5e6, "GiB is beyond"),
    (("optimizer", "seconds_per_param"), 1e20, "s is beyond"),
    (("comm", "p2p"), {"latency_s": 1e-5, "bandwidth_gbs": 1e-12}, "GB/s is below"),
    (("comm", "p2p_latency_s"), 3e7, "s is beyond"),
]


@pytest.mark.parametrize("path,value,says", ABSURD_PROFILE, ids=lambda x: ".".join(x) if isinstance(x, tuple)
                         else None)
def test_absurd_profile_figures_are_refused(path: tuple[str, ...], value: Any, says: str, tmp_path: Path):
    data = json.loads(json.dumps(CHIP_A))
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    f = tmp_path / "chip-a.yaml"
    f.write_text(yaml.safe_dump(data))
    line = one_error(CliRunner().invoke(cli, ["profile", "show", str(f)]))
    assert f"{f}: {'.'.join(path)}" in line and says in line, line
    # The planner reads it too (a profile directory): refused the same way, nothing written.
    out = tmp_path / "out" / "plan.yaml"
    line = one_error(CliRunner().invoke(cli, ["simulate", "--plan", str(TINY_PLAN), "--profile", str(tmp_path),
                                              "--trace", str(out)]))
    assert str(f) in line and says in line and not out.exists(), line


def test_sane_figures_at_the_bounds_are_read(tmp_path: Path):
    """The bounds leave every real figure alone: a million GB/s and a millionth, 1e-11 s per parameter."""
    data = json.loads(json.dumps(CHIP_A))
    data["compute"]["memory_bandwidth_gbs"] = 1e6
    data["comm"]["p2p"] = {"latency_s": 0.0, "bandwidth_gbs": 1e-6}
    data["optimizer"]["seconds_per_param"] = 1e-13
    f = tmp_path / "chip-a.yaml"
    f.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli, ["profile", "show", str(f)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("column,value,says", [
    ("forward_s", "1e25", "1e+25 s is beyond"),
    ("bandwidth_gbs", "1e-30", "1e-30 GB/s takes 4.096e+24 s for a 4,096-byte message"),  # a link curve's point
    ("seconds", "5e8", "s is beyond"),
    ("tp", "\uff11", "expected an integer"),       # full-width 1: int() read it as 1
    ("forward_s", "\u0661.5", "expected a number"),  # Arabic-Indic 1: float() read it as 1.5
])
def test_absurd_table_cells_are_refused(column: str, value: str, says: str, tmp_path: Path):
    lines = TABLE.strip().splitlines()
    header = lines[0].split(",")
    col = header.index(column)
    row = next(i for i, line in enumerate(lines) if i and line.split(",")[col])
    cells = lines[row].split(",")
    cells[col] = value
    lines[row] = ",".join(cells)
    table = tmp_path / "table.csv"
    table.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    line = one_error(CliRunner().invoke(cli, ["profile", "import", str(table), "--type", "chip-a", "--model",
                                              "llama-tiny", "--out", str(out)]))
    assert f"{table}:{row + 1}: {column}: " in line and says in line and not out.exists(), line


# Text options parsed by hand: int() read any script's digits; str.isdigit() took "²", which int() refuses.
@pytest.mark.parametrize("args,says", [
    (["replan", "--plan", str(TINY_PLAN), "--failed", "\uff11", "--time-limit", "1"], "--failed"),
    (["train", "--plan", str(TINY_PLAN), "--switch", f"\u00b2:{TINY_PLAN}", "--data", "/nonexistent"], "--switch"),
    (["profile", "--cluster", "cpu-hetero4", "--seq-lens", "\uff11\uff16,32,64", "--out", "OUT"], "--seq-lens"),
    (["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "\uff18", "--seq-len", "16",
      "-o", "OUT"], "--global-batch"),
    (["show", str(TINY_PLAN), "--device", "\uff10"], "--device"),
    (["check-numerics", "--seed", str(10**26)], "--seed"),                 # torch: "Overflow when unpacking"
    (["agent", "--coordinator", "127.0.0.1:\u00b2", "--node", "n", "--token", "t", "--timeout", "1"],
     "--coordinator"),                                                    # int("²"): a traceback
    (["agent", "--coordinator", "127.0.0.1:\uff11\uff12", "--node", "n", "--token", "t", "--timeout", "1"],
     "--coordinator"),                                                    # dialled port 12
])
def test_numbers_in_other_scripts_or_beyond_range_are_refused(args: list[str], says: str, tmp_path: Path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    line = one_error(CliRunner().invoke(cli, args))
    assert says in line and not (tmp_path / "out").exists(), line


@pytest.mark.parametrize("verb", [["show", str(TINY_PLAN)], ["simulate", "--plan", str(TINY_PLAN)],
                                  ["replan", "--plan", str(TINY_PLAN), "--failed", "0", "--time-limit", "1"]],
                         ids=lambda v: v[0])
@pytest.mark.parametrize("name", ["", "nope"])
def test_an_unknown_or_empty_strategy_names_the_plan(verb: list[str], name: str):
    """``show --strategy ""`` showed every strategy (an empty name read as none given); the other verbs said
    "strategies: no strategy named ''" without the file."""
    line = one_error(CliRunner().invoke(cli, [*verb, "--strategy", name]))
    assert f"{TINY_PLAN}: --strategy: no strategy named {name!r} (the plan has: hetero)" in line, line


def test_a_long_trace_of_repeated_events_is_modelled_quickly(tmp_path: Path):
    """200 events, one device lost and back 100 times: each event was a planner search (~0.4 s; 35-50 s in
    all). Repeated device sets are planned once now, and still charged the search's measured wall time."""
    events = [{"step": s, "action": a, "devices": [3]} for i in range(100)
              for s, a in ((2 * i + 1, "kill"), (2 * i + 2, "rejoin"))]
    trace = tmp_path / "events.yaml"
    trace.write_text(yaml.safe_dump({"events": events}))
    t0 = time.process_time()
    with deadline(120):
        result = CliRunner().invoke(cli, ["simulate", "--plan", str(TINY_PLAN), "--events", str(trace),
                                          "--format", "json"])
    cpu = time.process_time() - t0
    assert result.exit_code == 0, result.output
    assert cpu < 20, f"{cpu:.1f} s of CPU for 200 events"
    walls = [e["planner_wall_s"] for e in json.loads(result.output)["hspmd"]["events"] if e["event"] == "rejoin"]
    assert len(walls) == 100 and min(walls) > walls[0] / 2 > 0, walls[:5]  # not a free lookup


@pytest.mark.parametrize("events", [
    [{"step": 1, "action": "hang", "devices": [0, 1, 2, 3]}],
    [{"step": 2, "action": "kill", "node": "cpu0"}],
    [{"step": 1, "action": "kill", "devices": [0, 1, 2]}, {"step": 2, "action": "kill", "devices": [3]}],
], ids=["hang-all", "kill-node", "one-by-one"])
def test_a_trace_that_leaves_no_device_names_its_event(events: list[dict[str, Any]], tmp_path: Path):
    """Once "error: no devices to plan on" (no file, no field) from the middle of the modelled run."""
    trace = tmp_path / "events.yaml"
    trace.write_text(yaml.safe_dump({"events": events}))
    line = one_error(CliRunner().invoke(cli, ["simulate", "--plan", str(TINY_PLAN), "--events", str(trace)]))
    assert f"{trace}: events[{len(events) - 1}]: leaves no device running" in line, line


def test_a_large_plain_file_is_not_called_an_alias_bomb(tmp_path: Path):
    """More YAML values than the reader's bound, with no alias at all: said as it is (it read "YAML aliases
    expand to more than 250,000 nodes (an alias bomb?)")."""
    f = tmp_path / "plan.yaml"
    f.write_text("x: [" + "1," * 250_001 + "1]\n")
    line = one_error(CliRunner().invoke(cli, ["validate", str(f)]))
    assert f"{f}: " in line and "more than 250,000 YAML values" in line and "alias" not in line, line


@pytest.mark.parametrize("verb", [["show"], ["simulate", "--plan"], ["validate"]], ids=lambda v: v[0])
def test_names_that_read_as_markup_print_as_they_are(verb: list[str], tmp_path: Path):
    """A strategy named "[/red]" (a closing tag of rich markup) or a model named "[/bold]m" was a MarkupError
    traceback in every verb that printed it; now the line is printed with markup off, the name as written."""
    model = tmp_path / "m.yaml"
    model.write_text((REPO / "configs" / "models" / "llama-tiny.yaml").read_text()
                     .replace("name: llama-tiny", 'name: "[/bold]m"'))
    plan = tmp_path / "plan.yaml"
    plan.write_text(TINY_PLAN.read_text().replace("name: hetero", 'name: "[/red]s"')
                    .replace("model: llama-tiny", f"model: {model}"))
    result = CliRunner().invoke(cli, [*verb, str(plan)])
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "[/red]s" in result.output and "[/bold]m" in result.output, result.output


def test_a_documents_run_of_one_token_sequences_is_refused(tmp_path: Path):
    """seq_len 1 in documents mode cut every document into one-token pieces: one step trained on nothing
    (loss 0.0000, exit 0). Refused before any worker starts, naming the plan and the field."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(TINY_PLAN.read_text().replace("seq_len: 64", "seq_len: 1"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    metrics = tmp_path / "metrics.jsonl"
    with deadline(60):
        result = CliRunner().invoke(cli, ["train", "--plan", str(plan), "--data", str(data), "--steps", "1",
                                          "--metrics", str(metrics)])
    line = one_error(result)
    assert f"{plan}: training.seq_len: " in line and "no next token" in line and not metrics.exists(), line


@pytest.mark.parametrize("key,value", [("seq_scale", 2**50), ("time_scale", 1e29)])
def test_absurd_emulation_scales_are_refused(key: str, value: Any, tmp_path: Path):
    """seq_scale 2**50 priced a step at 5.5e26 s (and a run would sleep as long); time_scale 1e29 slept one
    block for ever. Bounded like slowdown, naming the file and the field."""
    data = yaml.safe_load((REPO / "configs" / "clusters" / "cpu-hetero4-sleep.yaml").read_text())
    data["device_types"]["emu-a800"]["emulate"][key] = value
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(data))
    plan = REPO / "configs" / "plans" / "cpu-hetero4-sleep-dp-pp.yaml"
    line = one_error(CliRunner().invoke(cli, ["validate", str(plan), "--cluster", str(cluster)]))
    assert f"{cluster}: device_types.emu-a800.emulate.{key}: " in line and ("at most" in line or "in [1," in line), line


def test_a_profile_path_that_is_no_file_says_what_it_is(tmp_path: Path):
    """``profile show DIR`` (or a looping link) said "no profile 'DIR'", as for a name that does not exist."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path, says in ((tmp_path, "is a directory, expected a file"), (loop, "symbolic links")):
        for verb in (["profile", "show", str(path)], ["profile", "export", str(path), "--out", str(tmp_path / "x")]):
            line = one_error(CliRunner().invoke(cli, verb))
            assert f"{path}: " in line and says in line and not (tmp_path / "x").exists(), line

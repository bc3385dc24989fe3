"""Hostile inputs the fourth pass left open: a failure trace through a thousand distinct device sets (a
planner search each, hours at paper scale), link-curve points of tiny messages refused by a rate floor meant
for rates, bidirectional and control characters in names, digit groups (``1_0``) on the command line and in
tables, and absurd norm epsilons and RoPE bases in Hugging Face configs. Each is one line naming the file (or
option) and the field, exit 2, nothing written; or, where the input is real, accepted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from test_hostile_bounds import CHIP_A, one_error
from test_hostile_files import REPO, TINY_PLAN, deadline, plan_referencing
from test_hostile_values import TABLE

from hetu_cli.main import cli
from runtime.torchfree.spec import load_model
from runtime.torchfree.spec.hf import config_for

PAPER_PLAN = REPO / "configs" / "plans" / "h800-h20-llama32b.yaml"


def distinct_sets_trace(pairs: int) -> dict[str, Any]:
    """Two H800/H20 devices lost one after the other and back together, a different pair each time: every
    event leaves a device set no event before it did (up to 2 per pair)."""
    every = [(a, b) for a in range(48) for b in range(a + 1, 48)]
    events, step = [], 1
    for a, b in every[:pairs]:
        events += [{"step": step + 1, "action": "kill", "devices": [a]},
                   {"step": step + 2, "action": "kill", "devices": [b]},
                   {"step": step + 3, "action": "rejoin", "devices": [a, b]}]
        step += 3
    return {"events": events}


def test_a_trace_of_a_thousand_distinct_device_sets_is_refused_at_once(tmp_path: Path):
    """999 events on the paper-scale plan, 342 distinct device sets: one planner search of 8-10 s each (and
    more for the restart and Oobleck-like lines), hours of one command. Refused before any search, saying how
    many sets and the budget."""
    trace = tmp_path / "events.yaml"
    trace.write_text(yaml.safe_dump(distinct_sets_trace(333)))
    t0 = time.perf_counter()
    with deadline(30):
        line = one_error(CliRunner().invoke(cli, ["simulate", "--plan", str(PAPER_PLAN), "--events", str(trace)]))
    assert f"{trace}: events: the trace passes through 342 distinct sets of running devices" in line, line
    assert "at most 100 searches" in line and "--max-searches" in line, line
    assert time.perf_counter() - t0 < 30


def test_the_search_budget_stops_a_trace_at_the_event_that_spends_it(tmp_path: Path):
    """Fewer distinct sets than the budget, but each a few searches (hspmd's, restart's, the Oobleck-like
    template): the model stops at the event that would run one search too many, naming it."""
    trace = tmp_path / "events.yaml"
    trace.write_text(yaml.safe_dump({"events": [{"step": 3, "action": "kill", "devices": [3]},
                                                {"step": 6, "action": "rejoin", "devices": [3]}]}))
    args = ["simulate", "--plan", str(TINY_PLAN), "--events", str(trace)]
    line = one_error(CliRunner().invoke(cli, [*args, "--max-searches", "3"]))
    assert f"{trace}: events[0]: needs a planner search beyond the 3 run so far" in line, line
    result = CliRunner().invoke(cli, [*args, "--max-searches", "6", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["hspmd"]["events"][0]["event"] == "kill"


def test_max_searches_needs_events():
    line = one_error(CliRunner().invoke(cli, ["simulate", "--plan", str(TINY_PLAN), "--max-searches", "5"]))
    assert "--max-searches: only with --events" in line, line


def curve_profile(tmp_path: Path, nbytes: list[int], gbs: list[float]) -> Path:
    data = json.loads(json.dumps(CHIP_A))
    data["comm"]["links"] = {"inter": {"send": {"bytes": nbytes, "bandwidth_gbs": gbs}}}
    f = tmp_path / "chip-a.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def test_a_latency_bound_tiny_message_is_a_real_point(tmp_path: Path):
    """One byte in 10 ms (TCP on a loaded host) is 1e-7 GB/s: the rate floor of 1e-6 GB/s refused it; a curve
    point is one message's effective rate, bounded by that message's time instead."""
    f = curve_profile(tmp_path, [1, 8, 1 << 20], [1e-7, 8e-7, 10.0])
    result = CliRunner().invoke(cli, ["profile", "show", str(f)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("nbytes,gbs,says", [
    ([1, 1 << 20], [1e-16, 10.0], "comm.links.inter.send.bandwidth_gbs[0]: 1e-16 GB/s takes 1e+07 s for a "
                                  "1-byte message"),
    ([1, 4096], [1e-4, 1e-8], "comm.links.inter.send.bandwidth_gbs[1]: 1e-08 GB/s at the largest message"),
    ([1, 4096], [1e-4, 1e7], "bandwidth_gbs[1]: 1e+07 GB/s is beyond"),
])
def test_absurd_curve_points_are_still_refused(nbytes: list[int], gbs: list[float], says: str, tmp_path: Path):
    f = curve_profile(tmp_path, nbytes, gbs)
    line = one_error(CliRunner().invoke(cli, ["profile", "show", str(f)]))
    assert f"{f}: " in line and says in line, line


@pytest.mark.parametrize("rows,says", [
    ("link,,,,,,,,,inter,send,,1,0.0000001,\n", None),                     # 1 byte in 10 ms: imported
    ("link,,,,,,,,,inter,send,,1,1e-16,\n", ":10: bandwidth_gbs: 1e-16 GB/s takes 1e+07 s for a 1-byte message"),
    ("link,,,,,,,,,intra,send,,4096,1e-8,\n", ":10: bandwidth_gbs: 1e-08 GB/s at the largest message (4,096 bytes)"),
])
def test_table_link_points_follow_the_same_rule(rows: str, says: str | None, tmp_path: Path):
    table = tmp_path / "table.csv"
    table.write_text(TABLE + rows)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["profile", "import", str(table), "--type", "chip-a", "--model", "llama-tiny",
                                      "--out", str(out)])
    if says is None:
        assert result.exit_code == 0, result.output
    else:
        line = one_error(result)
        assert f"{table}{says}" in line and not out.exists(), line


BIDI = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: "a800" shows as "008a"


@pytest.mark.parametrize("what", ["strategy", "device type", "model", "node"])
@pytest.mark.parametrize("char", [BIDI, "\u2066", "\x00", "\x1b", "\u200b"], ids=ascii)
def test_control_and_format_characters_in_names_are_refused(what: str, char: str, tmp_path: Path):
    escaped = json.dumps(char)[1:-1]  # YAML's double-quoted escapes are JSON's
    plan = tmp_path / "plan.yaml"
    if what in ("strategy", "model"):
        text = TINY_PLAN.read_text()
        if what == "strategy":
            text, field = text.replace("name: hetero", f'name: "he{escaped}tero"'), "strategies[0].name"
        else:
            model = tmp_path / "m.yaml"
            model.write_text((REPO / "configs" / "models" / "llama-tiny.yaml").read_text()
                             .replace("name: llama-tiny", f'name: "llama{escaped}"'))
            text, field, plan = text.replace("model: llama-tiny", f"model: {model}"), "name", model
        (tmp_path / "plan.yaml").write_text(text)
    else:
        cluster = tmp_path / "c.yaml"
        text = (REPO / "configs" / "clusters" / "cpu-hetero4.yaml").read_text()
        if what == "node":
            text, field = text.replace("name: cpu0", f'name: "cpu{escaped}0"', 1), "nodes[0].name"
        else:
            text, field = text.replace("cpu-fast:", f'"cpu{escaped}fast":', 1), f"device_types.cpu{escaped}fast"
        cluster.write_text(text)
        plan_referencing(tmp_path, cluster=cluster).rename(tmp_path / "plan.yaml")
        plan = cluster
    result = CliRunner().invoke(cli, ["validate", str(tmp_path / "plan.yaml")])
    line = one_error(result)
    assert char not in result.output and f"U+{ord(char):04X}" in line, ascii(line)
    if what != "device type":
        assert f"{plan}: {field}: contains" in line, ascii(line)


def test_format_characters_in_paths_are_escaped_where_printed(tmp_path: Path):
    """A path is the user's own, not refused; it is printed escaped (the error line showed it reordered)."""
    missing = tmp_path / f"plan{BIDI}lmay.yaml"
    result = CliRunner().invoke(cli, ["validate", str(missing)])
    line = one_error(result)
    assert BIDI not in result.output and "plan\\u202elmay.yaml" in line, ascii(line)


# int() reads "1_0" as 10 (PEP 515 digit groups): a typo of 1.0 or 10 planned a batch of 10.
DIGITS = "'_' is not a digit"


@pytest.mark.parametrize("args,says", [
    (["show", str(TINY_PLAN), "--device", "1_0"], f"--device': '1_0' is not a number: {DIGITS}"),  # was device 10
    (["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "1_6", "--seq-len", "16",
      "-o", "OUT"], f"--global-batch': '1_6' is not a number: {DIGITS}"),
    (["replan", "--plan", str(TINY_PLAN), "--failed", "0_1", "--time-limit", "1", "-o", "OUT"],
     "--failed: expected comma-separated device ids or ranges such as 5,6 or 16-23, got '0_1'"),
    (["replan", "--plan", str(TINY_PLAN), "--failed", "1", "--tolerance", "0.0_5", "-o", "OUT"],
     f"--tolerance': '0.0_5' is not a number: {DIGITS}"),
    (["profile", "--cluster", "cpu-hetero4", "--seq-lens", "1_6,32,64", "--out", "OUT"],
     "--seq-lens: expected comma-separated integers, got '1_6,32,64'"),
])
def test_digit_groups_on_the_command_line_are_refused(args: list[str], says: str, tmp_path: Path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    line = one_error(CliRunner().invoke(cli, args))
    assert says in line and not (tmp_path / "out").exists(), line


def test_digit_groups_in_a_table_cell_are_refused(tmp_path: Path):
    table = tmp_path / "table.csv"
    table.write_text(TABLE.replace(",1,1,2048,", ",1,1,2_048,", 1))
    out = tmp_path / "out"
    line = one_error(CliRunner().invoke(cli, ["profile", "import", str(table), "--type", "chip-a", "--model",
                                              "llama-tiny", "--out", str(out)]))
    assert f"{table}:2: seq_len: expected an integer, got '2_048'" in line and not out.exists(), line


@pytest.mark.parametrize("key,value,says", [
    ("rms_norm_eps", 1e29, "rms_norm_eps: must be in [1e-30, 0.1]"),
    ("rms_norm_eps", 0.5, "rms_norm_eps: must be in [1e-30, 0.1]"),
    ("rms_norm_eps", 1e-300, "rms_norm_eps: must be in [1e-30, 0.1]"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps: must be in [1e-30, 0.1]"),
    ("rope_theta", 1e29, "rope_theta: must be in (1, 1e+12]"),
    ("rope_theta", 0.5, "rope_theta: must be in (1, 1e+12]"),
    ("rope_theta", 0, "rope_theta: must be in (1, 1e+12]"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 1e20, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, "rope_scaling.factor: must be in [1, 10000]"),
    # 1e300 is beyond the readers' 1e30 (it was refused with a second line for the 0 standing in for it)
    ("rope_scaling", {"rope_type": "llama3", "factor": 1e300, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, "rope_scaling.factor: expected a finite number"),
    # read without the specs' integer bound: accepted, then overflowed RoPE's float arithmetic
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 10**400},
     "rope_scaling.original_max_position_embeddings: an integer of 401 digits is out of range"),
])
def test_absurd_eps_and_rope_figures_in_a_config_are_refused(key: str, value: Any, says: str, tmp_path: Path):
    config = config_for(load_model("llama-tiny"), "float32")
    config[key] = value
    f = tmp_path / "config.json"
    f.write_text(json.dumps(config))
    line = one_error(CliRunner().invoke(cli, ["validate", str(plan_referencing(tmp_path, model=f))]))
    assert f"{f}: {says}" in line, line


def test_published_eps_and_rope_figures_are_read(tmp_path: Path):
    """The bounds leave every published figure alone: BERT's 1e-12, a 1M-context Llama 3's 3.6e9 base."""
    config = config_for(load_model("llama-tiny"), "float32")
    config.update(rms_norm_eps=1e-12, rope_theta=3580165449.0)
    f = tmp_path / "config.json"
    f.write_text(json.dumps(config))
    assert load_model(str(f)).rope_theta == 3580165449.0


def test_format_characters_in_a_path_are_escaped_in_what_a_verb_prints(tmp_path: Path):
    """The console (tables and lines alike) prints a path with U+202E escaped; the file is written as named."""
    trace = tmp_path / f"t{BIDI}nosj.json"
    result = CliRunner().invoke(cli, ["simulate", "--plan", str(TINY_PLAN), "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    assert BIDI not in result.output and "t\\u202enosj.json" in result.output and trace.exists(), ascii(result.output)


@pytest.mark.parametrize("verb", [
    ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8", "--seq-len", "16",
     "--time-limit", "1", "--check-top", "0", "-o"],
    ["simulate", "--plan", str(TINY_PLAN), "--trace"],
    ["replan", "--plan", str(TINY_PLAN), "--failed", "3", "--time-limit", "1", "-o"],
], ids=lambda v: v[0])
def test_an_output_that_is_no_regular_file_is_not_replaced(verb: list[str], tmp_path: Path):
    """A new file is renamed over its target: ``plan -o /dev/null`` as root replaced the device node with the
    plan (a named pipe stands in for it here). Refused before any work, the pipe left as it was."""
    import os
    import stat

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    line = one_error(CliRunner().invoke(cli, [*verb, str(pipe)]))
    assert f"{pipe}: " in line and "is a named pipe, expected a regular file" in line, line
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)


def test_atomic_writes_refuse_to_replace_a_pipe(tmp_path: Path):
    """The writers' backstop (runtime/torchfree/spec/io.py AtomicFiles), for a caller that checked nothing first."""
    import os
    import stat

    from runtime.torchfree.errors import SpecError
    from runtime.torchfree.spec.io import atomic_write_text

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(SpecError, match="is a named pipe"):
        atomic_write_text(pipe, "x")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode) and os.listdir(tmp_path) == ["pipe"]


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full (every write: ENOSPC)")
def test_a_metrics_file_that_cannot_be_written_is_one_line():
    """``--metrics /dev/full`` (a full disk): os.write's OSError names no file, so it was a traceback after
    the first step. Now one line naming the file and the option, exit 2, the workers stopped."""
    with deadline(120):
        result = CliRunner().invoke(cli, ["train", "--plan", str(TINY_PLAN), "--steps", "1", "--metrics",
                                          "/dev/full"])
    line = one_error(result)
    assert line == "error: /dev/full: --metrics: cannot write: No space left on device", line


@pytest.mark.parametrize("ref", ["", "  "])
def test_an_empty_model_reference_names_nothing(ref: str, tmp_path: Path):
    """``model: ""`` resolved as a path to the plan's own directory, and loaded any config.json beside it."""
    (tmp_path / "config.json").write_text(json.dumps(config_for(load_model("llama-tiny"), "float32")))
    plan = tmp_path / "plan.yaml"
    plan.write_text(TINY_PLAN.read_text().replace("model: llama-tiny", f'model: "{ref}"'))
    line = one_error(CliRunner().invoke(cli, ["validate", str(plan)]))
    assert f"{plan}: model: unknown model {ref!r}" in line, line


@pytest.mark.parametrize("shape", ["dir-without-config", "config-is-a-dir", "device"])
def test_a_model_path_that_names_no_file_says_what_it_names(tmp_path: Path, shape: str) -> None:
    """A model path that exists but is no spec file: the reason, not "unknown model" (it had listed the
    catalog as if the name were a typo)."""
    from runtime.torchfree.errors import SpecError

    ref = {"dir-without-config": tmp_path, "config-is-a-dir": tmp_path, "device": Path("/dev/null")}[shape]
    if shape == "config-is-a-dir":
        (tmp_path / "config.json").mkdir()
    with pytest.raises(SpecError) as err:
        load_model(str(ref))
    msg = str(err.value)
    assert "unknown model" not in msg
    assert {"dir-without-config": "is a directory without a config.json",
            "config-is-a-dir": "config.json' is not a regular file",
            "device": "is not a regular file"}[shape] in msg


def test_a_cluster_path_that_is_a_directory_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["plan", "--model", "llama-tiny", "--cluster", str(tmp_path), "--global-batch",
                                      "8", "--seq-len", "64", "-o", str(tmp_path / "p.yaml")])
    assert result.exit_code == 2
    assert "is a directory, not a YAML file" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "p.yaml").exists()

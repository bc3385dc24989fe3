"""One CLI shape: the plan as the first argument, click's errors as one ``error:`` line, portable plan files,
output paths checked before any worker starts, ``--metrics -``, and the notes and files a new user needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.commands.export import carry_side_files
from hetu_cli.commands.train import STDOUT, MetricsFile, random_weights_note
from hetu_cli.main import cli
from runtime.torchfree.hf_files import copy_side_files
from runtime.torchfree.spec import load_plan_context
from runtime.torchfree.spec.catalog import load_plan

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml"
CLUSTER = REPO / "configs" / "clusters" / "cpu-hetero4.yaml"
PLAN_ARGS = ["--model", "llama-tiny", "--global-batch", "8", "--seq-len", "64", "--time-limit", "5",
             "--check-top", "0", "--top-k", "1"]


def run(args: list[str]):
    return CliRunner().invoke(cli, args)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


@pytest.mark.parametrize("args", [
    ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "0", "--seq-len", "64"],
    ["simulate"],
    ["simulate", str(TINY), "--bogus"],
    ["no-such-verb"],
])
def test_click_usage_errors_are_one_error_line_and_exit_2(args):
    res = run(args)
    lines = error_lines(res.output)
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "Usage:" not in res.output and "Try '" not in res.output


@pytest.mark.parametrize("verb", [["simulate"], ["replan", "--failed", "9"]])
def test_verbs_that_read_a_plan_take_it_as_the_first_argument_or_as_plan(verb):
    positional = run([verb[0], str(TINY), *verb[1:], "--format", "json"])
    option = run([verb[0], "--plan", str(TINY), *verb[1:], "--format", "json"])
    assert positional.exit_code == option.exit_code, (positional.output, option.output)
    assert positional.output == option.output


def test_two_different_plans_are_a_usage_error():
    res = run(["simulate", str(TINY), "--plan", str(REPO / "configs" / "plans" / "cpu-hetero4-symmetric.yaml")])
    assert res.exit_code == 2 and res.output.startswith("error: two plans given"), res.output


def test_train_takes_the_plan_as_its_first_argument(tmp_path: Path):
    # --trace at a file is refused before anything starts: the positional plan was accepted first.
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = run(["train", str(TINY), "--trace", str(afile)])
    assert res.exit_code == 2 and "--trace: is a file, expected a directory" in res.output, res.output


def test_plan_files_record_their_cluster_relative_to_themselves_and_survive_a_move(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(CLUSTER, run_dir / "cluster.yaml")
    res = run(["plan", *PLAN_ARGS, "--cluster", str(run_dir / "cluster.yaml"), "-o", str(run_dir / "plan.yaml")])
    assert res.exit_code == 0, res.output
    plan = load_plan(run_dir / "plan.yaml")
    assert plan.cluster == "cluster.yaml" and plan.model == "llama-tiny"
    moved = tmp_path / "moved"
    run_dir.rename(moved)
    res = run(["validate", str(moved / "plan.yaml")])
    assert res.exit_code == 0, res.output


def test_a_plan_in_another_directory_records_the_way_there(tmp_path: Path):
    (tmp_path / "specs").mkdir()
    shutil.copy(CLUSTER, tmp_path / "specs" / "c.yaml")
    res = run(["plan", *PLAN_ARGS, "--cluster", str(tmp_path / "specs" / "c.yaml"), "-o",
               str(tmp_path / "plans" / "p.yaml")])
    assert res.exit_code == 0, res.output
    assert load_plan(tmp_path / "plans" / "p.yaml").cluster == "../specs/c.yaml"


@pytest.mark.parametrize("args", [
    ["validate", str(TINY), "--cluster", "missing/cluster.yaml"],
    ["plan", *PLAN_ARGS, "--cluster", "missing/cluster.yaml"],
])
def test_a_missing_cluster_path_is_file_not_found_not_an_unknown_name(args):
    res = run(args)
    assert res.exit_code == 2 and "file not found" in res.output and "unknown cluster" not in res.output, res.output


def test_a_plan_naming_a_moved_cluster_file_says_file_not_found(tmp_path: Path):
    shutil.copy(CLUSTER, tmp_path / "c.yaml")
    res = run(["plan", *PLAN_ARGS, "--cluster", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 0, res.output
    (tmp_path / "c.yaml").unlink()
    res = run(["validate", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2 and "file not found" in res.output, res.output


def test_cluster_and_model_overrides_replace_the_plans_own(tmp_path: Path):
    plan = tmp_path / "p.yaml"
    plan.write_text(TINY.read_text().replace("cluster: cpu-hetero4", "cluster: gone.yaml"))
    with pytest.raises(Exception, match="file not found"):
        load_plan_context(plan)
    ctx = load_plan_context(plan, cluster="cpu-hetero4", model="llama-tiny")
    assert ctx.cluster.name == "cpu-hetero4" and ctx.plan.cluster == "cpu-hetero4"
    res = run(["simulate", str(plan), "--cluster", "cpu-hetero4", "--model", "llama-tiny", "--format", "json"])
    assert res.exit_code == 0, res.output
    res = run(["train", str(plan), "--cluster", "missing/c.yaml", "--steps", "0"])
    assert res.exit_code == 2 and "--cluster: cluster 'missing/c.yaml': file not found" in res.output, res.output


def test_metrics_dash_is_standard_output_and_no_file(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sink = MetricsFile(STDOUT)
    sink.write_line({"step": 1, "loss": 2.5})
    sink.close()
    assert json.loads(capsys.readouterr().out) == {"step": 1, "loss": 2.5}
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("option", ["--metrics", "--trace", "--save"])
def test_output_paths_are_checked_before_workers_start(tmp_path: Path, option: str):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    target = tmp_path if option == "--metrics" else blocker   # a directory for a file, a file for a directory
    res = run(["train", str(TINY), option, str(target), "--steps", "1"])
    assert res.exit_code == 2, res.output
    assert option in res.output and "started" not in res.output and "step 1" not in res.output, res.output


def hf_dir(path: Path, weights: bool) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text('{"tok": 1}')
    (path / "generation_config.json").write_text('{"gen": 1}')
    if weights:
        (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_a_plan_of_an_hf_directory_with_weights_notes_random_init_without_load(tmp_path: Path):
    hf_dir(tmp_path / "tiny", weights=True)
    hf_dir(tmp_path / "bare", weights=False)
    for name in ("tiny", "bare"):
        (tmp_path / f"{name}.yaml").write_text(TINY.read_text().replace("model: llama-tiny", f"model: {name}"))
    note = random_weights_note(tmp_path / "tiny.yaml", None)
    assert note is not None and "random weights" in note and f"--load {tmp_path / 'tiny'}" in note
    assert random_weights_note(tmp_path / "bare.yaml", None) is None
    assert random_weights_note(TINY, None) is None   # a catalog model has no weights to miss


def test_side_files_travel_into_a_checkpoint_and_an_export(tmp_path: Path):
    src = hf_dir(tmp_path / "src", weights=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    copied = copy_side_files(src, ckpt)
    assert sorted(p.name for p in copied) == ["generation_config.json", "tokenizer.json"]
    assert (ckpt / "tokenizer.json").read_text() == '{"tok": 1}'
    out = tmp_path / "out"
    out.mkdir()
    assert sorted(p.name for p in carry_side_files(ckpt, None, out)) == ["generation_config.json", "tokenizer.json"]
    bare, out2 = tmp_path / "bare-ckpt", tmp_path / "out2"
    bare.mkdir()
    out2.mkdir()
    assert [p.name for p in carry_side_files(bare, str(src), out2)] == ["tokenizer.json", "generation_config.json"]


def test_agent_prints_no_cpp_stack_frames_when_the_coordinator_is_not_up():
    import socket

    with socket.socket() as s:   # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([sys.executable, "-m", "hetu_cli", "agent", "--coordinator", f"127.0.0.1:{port}",
                          "--node", "cpu0", "--token", "t", "--timeout", "1"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "frame #" not in res.stderr and "Exception raised from" not in res.stderr, res.stderr
    assert error_lines(res.stderr) and all(line.startswith("error: ") for line in error_lines(res.stderr)), res.stderr


def test_failed_takes_ranges_for_a_node():
    from hetu_cli.commands.replan import parse_devices

    assert parse_devices("16-23", "--failed") == list(range(16, 24))
    assert parse_devices("1,3-4", "--failed") == [1, 3, 4]
    for bad in ("5-3", "0-99999999999", "1--2", "-1"):
        with pytest.raises(Exception, match="ranges such as"):
            parse_devices(bad, "--failed")

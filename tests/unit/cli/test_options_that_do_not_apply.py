"""An option given where it does not apply is refused (one line, exit 2), never accepted and ignored."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from hetu_cli.main import cli

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "configs" / "plans" / "cpu-hetero4-tiny.yaml")
PLAN_TINY = ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8", "--seq-len", "64"]


def events_file(tmp_path: Path) -> str:
    path = tmp_path / "trace.yaml"
    path.write_text("events:\n  - {step: 2, action: kill, devices: [3]}\n")
    return str(path)


@pytest.mark.parametrize("args, lines", [
    (["simulate", "--plan", TINY, "--steps", "5"], ["--steps: only with --lengths"]),
    (["simulate", "--plan", TINY, "--tokens-per-step", "64"], ["--tokens-per-step: only with --lengths"]),
    (["simulate", "--plan", TINY, "--events", "EVENTS", "--trace", "OUT/t.json"],
     ["--trace: not with --events (the failure model writes no timeline)"]),
    (["simulate", "--plan", TINY, "--events", "EVENTS", "--lengths", "longtail", "--tokens-per-step", "64"],
     ["--events: not with --lengths (it models failures of fixed-length steps)"]),
    ([*PLAN_TINY, "--tokens-per-step", "512", "--max-strategies", "2", "--fixed-out", "OUT/f.yaml"],
     ["--tokens-per-step: only with --lengths", "--max-strategies: only with --lengths",
      "--fixed-out: only with --lengths"]),
    (["show", TINY, "--all-ops"], ["--all-ops: only with --device N"]),
    (["profile", "--out", "OUT", "--format", "json", "show", "H800"],
     ["--out: only when measuring, not before 'profile show' (its own options follow it)",
      "--format: only when measuring, not before 'profile show' (its own options follow it)"]),
    (["show", TINY, "--device", "0", "--annotations"], ["--annotations: not with --device (one view at a time)"]),
    (["train", "--plan", TINY, "--steps", "1", "--profile", "OUT"],
     ["--profile: only with --elastic (replanning) or --dispatch-costs profiles"]),
    (["train", "--plan", TINY, "--steps", "1", "--bind", "127.0.0.1:1234", "--token", "t"],
     ["--bind: only with --agents N", "--token: only with --agents N"]),
    (["train", "--plan", TINY, "--steps", "1", "--long-documents", "truncate"],
     ["--long-documents: only for documents (--lengths, --tokenizer, --data FILE.jsonl, or a plan with "
      "training.tokens_per_step); this run trains fixed windows"]),
    (["train", "--plan", TINY, "--steps", "1", "--no-preplan", "--replan-tolerance", "0.1"],
     ["--replan-tolerance: only with --elastic", "--preplan/--no-preplan: only with --elastic"]),
    # Once ignored: a CPU-emulated cluster's types are all measured on this CPU, whatever --device-type says.
    (["profile", "--cluster", "cpu-hetero4", "--device-type", "nope", "--out", "OUT/p"],
     ["--device-type: only for GPU clusters (cluster 'cpu-hetero4' is CPU-emulated: all its types are measured on "
      "this CPU)"]),
])
def test_refused_in_one_line_each(args, lines, tmp_path: Path) -> None:
    args = [a.replace("OUT", str(tmp_path)).replace("EVENTS", events_file(tmp_path)) if isinstance(a, str) else a
            for a in args]
    before = sorted(tmp_path.iterdir())
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [f"error: {line}" for line in lines]
    assert sorted(tmp_path.iterdir()) == before   # nothing written


@pytest.mark.parametrize("args", [
    ["simulate", "--plan", TINY],                      # --steps keeps its default: not "given"
    ["show", TINY, "--device", "0", "--all-ops"],
    ["show", TINY, "--annotations"],
    ["profile", "show", "H800", "--format", "json"],
])
def test_defaults_and_applicable_options_still_run(args) -> None:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output

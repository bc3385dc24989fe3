"""The torchrun-compatible entry: ``torchrun ... -m hetu_cli train --plan PLAN`` (the multi-node path)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from train_helpers import REPO, reference, write_plan


def test_torchrun_two_processes_train_like_the_reference_on_a_text_file(tmp_path):
    plan = write_plan(tmp_path / "pp2.yaml", "pp2", [(2, [([0], (0, 2)), ([1], (2, 6))])], global_batch=2)
    text = tmp_path / "corpus.txt"
    text.write_text("HSPMD: heterogeneous SPMD for clusters whose devices are not alike.\n" * 40)
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hetu_cli", "train", "--plan", str(plan), "--steps", "2", "--data", str(text),
         "--metrics", str(metrics), "--timeout", "60"],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(x["strategy"] == "pp2" for x in lines)
    expected, _ = reference(plan, 2, data_file=text)
    assert [x["loss"] for x in lines] == pytest.approx(expected, rel=1e-5)

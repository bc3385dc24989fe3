"""The verbs that do not train never load torch (docs/design.md §8): start-up stays a fraction of a second.

Each verb runs in a fresh interpreter (this test process has torch loaded already) and reports whether
``torch`` ended up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAN = str(REPO / "configs" / "plans" / "cpu-hetero4-dp-pp.yaml")

PROBE = """
import sys
from hetu_cli.main import cli
try:
    cli.main(sys.argv[1:], prog_name="hspmd", standalone_mode=False)
    code = 0
except SystemExit as e:
    code = e.code
loaded = {"json": "json" in sys.modules}  # before this probe imports it to report
import json
print(json.dumps({**loaded, "torch": "torch" in sys.modules, "code": code,
                  "scheduler": any(m in sys.modules for m in (
                      "runtime.torchfree.pipeline_schedules", "runtime.torchfree.list_scheduler",
                      "runtime.torchfree.schedule_types", "runtime.torchfree.schedule_actions",
                      "runtime.torchfree.schedule_check"))}))
"""


def _run(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [
    ["--help"],
    ["validate", PLAN],
    ["show", PLAN, "--annotations"],
    ["show", PLAN, "--device", "0"],
    ["simulate", "--plan", PLAN],
    ["replan", "--plan", PLAN, "--failed", "3", "--time-limit", "5"],
    ["plan", "--model", "llama-tiny", "--cluster", "cpu-hetero4", "--global-batch", "8", "--seq-len", "64",
     "--time-limit", "5", "--check-top", "1"],
], ids=lambda a: a[0])
def test_verb_does_not_load_torch(args):
    out = _run(args)
    assert out["code"] in (0, None), out
    assert out["torch"] is False, f"hspmd {' '.join(args)} loaded torch"


def test_validate_loads_neither_the_scheduler_nor_json():
    # The start-up target (validate within 1.5x of importing yaml, click and rich) has a few ms of slack:
    # defining the list scheduler's op classes cost a tenth of validate's start, and validate needs only
    # the schedules' policies and bounds (runtime/torchfree/schedule_policies.py).
    out = _run(["validate", PLAN])
    assert out["code"] in (0, None), out
    assert out["scheduler"] is False and out["json"] is False, out


def test_the_probe_sees_torch_when_it_is_loaded():
    # A control: the same check notices torch when a module that needs it is imported.
    proc = subprocess.run([sys.executable, "-c", "import runtime.models.llama, sys; print('torch' in sys.modules)"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout.strip() == "True"

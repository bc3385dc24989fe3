"""gpu_check.py's pure helpers: device type names from nvidia-smi, datasheet lookup, loss tolerances."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up while the class is made
spec.loader.exec_module(gpu_check)


@pytest.mark.parametrize("smi, name", [("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3"), ("NVIDIA H200", "H200"),
                                       ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "GeForce-RTX-4090"),
                                       ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"), ("  ", "gpu")])
def test_type_name(smi, name):
    assert gpu_check.type_name(smi) == name


def test_datasheet_matches_whole_names_only():
    h100 = gpu_check.datasheet("H100-80GB-HBM3")
    assert h100 is not None and h100[2] == "profiles/H100.yaml (spec)"
    assert gpu_check.datasheet("A100-SXM4-80GB")[2] == "profiles/A100-80G.yaml (spec)"
    assert gpu_check.datasheet("GeForce-RTX-4090")[2] == "profiles/RTX4090.yaml (spec)"
    h200 = gpu_check.datasheet("H200")  # not the H20's figures
    assert h200 == (989.0, 4800.0, "gpu_check.py datasheet table")
    assert gpu_check.datasheet("H20")[2] == "profiles/H20.yaml (spec)"
    assert gpu_check.datasheet("Quadro-P1000") is None  # measured on the machine instead


def test_loss_comparison():
    ref = [5.0, 4.0, 3.0]
    ok = gpu_check.compare_losses([5.02, 4.1, 3.05], ref)
    assert ok["ok"] and [r["tolerance"] for r in ok["steps"]] == [1e-2, 3e-2, 3e-2]
    assert not gpu_check.compare_losses([5.06, 4.0, 3.0], ref)["ok"]       # step 1 off by 1.2%
    assert not gpu_check.compare_losses([5.0, 4.0], ref)["ok"]             # a step missing
    assert not gpu_check.compare_losses([5.0, float("nan"), 3.0], ref)["ok"]

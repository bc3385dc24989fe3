"""Placement mismatches (node, GPU index, GPU type) are refused in one line, exit 2, before anything is
built: under the hspmd launcher and under torchrun on loopback, with the machine's GPUs described
(runtime/launch/placement.py ``FixedGpus``) since this host has none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import REPO

from runtime.launch.launcher import launch
from runtime.launch.options import TrainOptions
from runtime.launch.placement import GIB, FixedGpus, GpuInfo
from runtime.launch.supervise import WorkerFailure

CLUSTER = """\
name: two-boxes
device_types:
  H100: {memory_gib: 80, peak_bf16_tflops: 989, hbm_bandwidth_gbs: 3350, intra_node_bandwidth_gbs: 450}
  H20: {memory_gib: 96, peak_bf16_tflops: 148, hbm_bandwidth_gbs: 4000, intra_node_bandwidth_gbs: 450}
inter_node_bandwidth_gbs: 25
nodes:
  - {name: box-a, device_type: H100, count: 4}
  - {name: box-b, device_type: H20, count: 1}
"""

PLAN = """\
version: 1
model: llama-tiny
cluster: cluster.yaml
training:
  global_batch: 2
  micro_batch: 1
  seq_len: 16
  schedule: 1f1b
  seed: 0
  optimizer: {{lr: 0.001, weight_decay: 0.0, beta1: 0.9, beta2: 0.95, eps: 1.0e-08, grad_clip: 1.0}}
strategies:
- name: two
  pipelines:
  - micro_batches: 2
    stages:
    - {{devices: [{a}], layers: [0, 3]}}
    - {{devices: [{b}], layers: [3, 6]}}
"""

H100 = GpuInfo("NVIDIA H100 80GB HBM3", 85_029_158_912)
H20 = GpuInfo("NVIDIA H20", 102_005_473_280)


def plan(tmp_path: Path, a: int, b: int) -> Path:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.yaml").write_text(PLAN.format(a=a, b=b))
    return tmp_path / "plan.yaml"


def refused(options: TrainOptions) -> str:
    with pytest.raises(WorkerFailure) as info:
        launch(options)
    assert info.value.exit_code == 2
    lines = info.value.lines()
    assert len(lines) == 1, lines
    return lines[0]


def test_launcher_refuses_the_wrong_gpu_type_and_node(tmp_path: Path) -> None:
    p = plan(tmp_path, 2, 3)   # devices 2 and 3 of box-a: GPUs 2 and 3 (0 and 1 idle)
    line = refused(TrainOptions(plan=p, steps=1, timeout_s=30, node="box-a", gpus=FixedGpus("h", (H20,) * 4)))
    assert "expected H100 (80 GiB) as GPU 2 of node 'box-a'" in line or "as GPU 3 of node 'box-a'" in line
    assert "found 'NVIDIA H20' with 95.0 GiB" in line
    line = refused(TrainOptions(plan=p, steps=1, timeout_s=30, node="box-b", gpus=FixedGpus("h", (H100,) * 4)))
    assert "expected H100" in line and "found node 'box-b'" in line


def test_launcher_refuses_a_gpu_index_this_machine_lacks(tmp_path: Path) -> None:
    from runtime.torchfree.errors import HspmdError

    with pytest.raises(HspmdError, match="needs 4 on this node, but 2 CUDA device"):
        launch(TrainOptions(plan=plan(tmp_path, 2, 3), steps=1, node="box-a", gpus=FixedGpus("h", (H100,) * 2)))


def torchrun(p: Path, nproc: int, node: str, gpu: GpuInfo, count: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(Path(__file__).with_name("fake_gpu_torchrun.py")), str(p), node, gpu.name, str(gpu.memory_bytes / GIB),
         str(count)], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_torchrun_refuses_the_wrong_type_and_the_wrong_process_count(tmp_path: Path) -> None:
    p = plan(tmp_path, 1, 3)   # box-a runs devices 1 and 3 on GPUs 1 and 3
    proc = torchrun(p, 2, "box-a", H20, 4)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("rank ")]
    assert errors and all("expected H100 (80 GiB)" in x and "found 'NVIDIA H20'" in x for x in errors), proc.stderr
    assert any("as GPU 1 of node 'box-a'" in x or "as GPU 3 of node 'box-a'" in x for x in errors)
    proc = torchrun(p, 3, "box-a", H100, 4)   # 3 processes for a plan of 2 devices
    assert "--nproc-per-node" in proc.stderr and proc.returncode != 0

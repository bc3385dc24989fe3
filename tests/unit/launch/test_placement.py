"""The start-up placement check: node, GPU index and GPU type (name and memory) against the cluster file,
and torchrun's local rank -> device mapping by node."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.launch.placement import (
    GIB,
    FixedGpus,
    GpuInfo,
    check_placement,
    names_gpu,
    placement_problem,
    torchrun_device,
)
from runtime.torchfree.errors import HspmdError
from runtime.torchfree.spec.catalog import load_cluster
from runtime.torchfree.spec.cluster import DeviceType

H100 = GpuInfo("NVIDIA H100 80GB HBM3", 85_029_158_912)   # what torch reports for an 80 GB H100 SXM
H20 = GpuInfo("NVIDIA H20", 102_005_473_280)

CLUSTER = """\
name: mixed
device_types:
  H100: {memory_gib: 80, peak_bf16_tflops: 989, hbm_bandwidth_gbs: 3350, intra_node_bandwidth_gbs: 450}
  H20: {memory_gib: 96, peak_bf16_tflops: 148, hbm_bandwidth_gbs: 4000, intra_node_bandwidth_gbs: 450}
  fast: {memory_gib: 96, peak_bf16_tflops: 148, hbm_bandwidth_gbs: 4000, intra_node_bandwidth_gbs: 450,
         gpu_names: ["NVIDIA H20"]}
inter_node_bandwidth_gbs: 25
nodes:
  - {name: box-a, device_type: H100, count: 4}
  - {name: box-b, device_type: H20, count: 2}
  - {name: box-b, device_type: fast, count: 1}
"""


@pytest.fixture()
def cluster(tmp_path: Path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    return load_cluster(str(tmp_path / "c.yaml"))


def kind(**kw) -> DeviceType:
    return DeviceType(memory_gib=80, peak_bf16_tflops=1, hbm_bandwidth_gbs=1, intra_node_bandwidth_gbs=1, **kw)


@pytest.mark.parametrize("type_name,gpu,ok", [
    ("H100", "NVIDIA H100 80GB HBM3", True),
    ("H100-80GB-HBM3", "NVIDIA H100 80GB HBM3", True),
    ("A100-80GB", "NVIDIA A100-SXM4-80GB", True),
    ("H20", "NVIDIA H200", False),
    ("H200", "NVIDIA H20", False),
    ("A100", "NVIDIA H100 80GB HBM3", False),
    ("gpu-a", "NVIDIA H100 80GB HBM3", False),
])
def test_type_names_name_gpus(type_name: str, gpu: str, ok: bool) -> None:
    assert names_gpu(type_name, kind(), gpu) is ok


def test_gpu_names_list_the_reported_names() -> None:
    assert names_gpu("gpu-a", kind(gpu_names=("NVIDIA H100 80GB HBM3",)), "nvidia h100 80gb hbm3")
    assert not names_gpu("H100", kind(gpu_names=("NVIDIA H800",)), "NVIDIA H100 80GB HBM3")


def test_the_right_machine_passes(cluster) -> None:
    box_b = FixedGpus("box-b", (H20, H20, H20))
    for device, gpu in ((4, 0), (5, 1), (6, 2)):
        assert placement_problem(cluster, device, device, None, "box-b", gpu, box_b) is None
    # Declared node (--node) instead of the host name; a host name's first label also names the node.
    assert placement_problem(cluster, 0, 0, "box-a", "x.example", 0, FixedGpus("x", (H100,))) is None
    assert placement_problem(cluster, 0, 0, None, "box-a.example.org", 0, FixedGpus("x", (H100,))) is None


def test_mismatches_are_one_line_naming_rank_expected_and_found(cluster) -> None:
    wrong_node = placement_problem(cluster, 0, 3, None, "box-b", 0, FixedGpus("box-b", (H100,)))
    assert wrong_node is not None and "rank 3 (device 0)" in wrong_node and "'box-a'" in wrong_node
    assert "host 'box-b'" in wrong_node and "\n" not in wrong_node
    no_gpu = placement_problem(cluster, 3, 3, None, "box-a", 3, FixedGpus("box-a", (H100,) * 3))
    assert no_gpu is not None and "GPU 3 of node 'box-a'" in no_gpu and "found 3 visible GPU(s)" in no_gpu
    wrong_type = placement_problem(cluster, 1, 1, None, "box-a", 1, FixedGpus("box-a", (H100, H20)))
    assert wrong_type is not None and "expected H100 (80 GiB)" in wrong_type and "'NVIDIA H20'" in wrong_type
    small = GpuInfo("NVIDIA H100 PCIe", 40 * GIB)
    wrong_memory = placement_problem(cluster, 0, 0, None, "box-a", 0, FixedGpus("box-a", (small,)))
    assert wrong_memory is not None and "40.0 GiB" in wrong_memory and "memory_gib" in wrong_memory
    with pytest.raises(HspmdError, match=r"^rank 5 \(device 5\)"):
        check_placement(cluster, 5, 5, None, 1, FixedGpus("box-a", (H100, H100)))


@given(st.floats(0.5, 2.0))
def test_memory_within_the_tolerance_only(ratio: float) -> None:
    from runtime.launch.placement import MEMORY_TOLERANCE

    gpu = GpuInfo("NVIDIA H100", int(80 * GIB * ratio))
    c = load_cluster_text()
    problem = placement_problem(c, 0, 0, None, "box-a", 0, FixedGpus("box-a", (gpu,)))
    assert (problem is None) == (abs(ratio - 1) <= MEMORY_TOLERANCE)


def load_cluster_text():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "c.yaml").write_text(CLUSTER)
        return load_cluster(str(Path(d) / "c.yaml"))


def test_torchrun_maps_local_ranks_to_the_nodes_devices(cluster) -> None:
    # The plan runs devices 1, 3 of box-a (GPUs 0 and 2 idle) and all three of box-b.
    devices = [1, 3, 4, 5, 6]
    assert [torchrun_device(cluster, devices, "box-a", r, 2) for r in range(2)] == [1, 3]
    assert [torchrun_device(cluster, devices, "box-b", r, 3) for r in range(3)] == [4, 5, 6]
    with pytest.raises(HspmdError, match="torchrun started 4 process.*runs 2 device.*--nproc-per-node 2"):
        torchrun_device(cluster, devices, "box-a", 0, 4)


def test_torchrun_lines_start_each_node_with_its_own_devices(cluster) -> None:
    from runtime.launch.placement import torchrun_commands

    # box-a runs devices 1 and 3 (GPUs 0 and 2 idle), box-b all three of its devices.
    lines = torchrun_commands(cluster, [1, 3, 4, 5, 6], "p.yaml", "head:29500")
    assert [n for n, _ in lines] == ["box-a", "box-b"]
    assert "--nnodes 2 --nproc-per-node 2 " in lines[0][1] and lines[0][1].endswith("--plan p.yaml --node box-a")
    assert "--nproc-per-node 3 " in lines[1][1] and "--rdzv-endpoint head:29500" in lines[1][1]
    # What each line starts is what torchrun_device maps: the node's devices, one per local rank.
    assert [torchrun_device(cluster, [1, 3, 4, 5, 6], "box-b", r, 3) for r in range(3)] == [4, 5, 6]


def test_bf16_on_a_gpu_that_only_emulates_it_is_refused(cluster) -> None:
    v100_like = GpuInfo("NVIDIA H100 80GB HBM3", H100.memory_bytes, native_bf16=False)
    machine = FixedGpus("box-a", (v100_like,))
    problem = placement_problem(cluster, 0, 0, None, "box-a", 0, machine, bf16=True)
    assert problem is not None and "no native bf16" in problem and "--precision fp32" in problem
    assert placement_problem(cluster, 0, 0, None, "box-a", 0, machine, bf16=False) is None

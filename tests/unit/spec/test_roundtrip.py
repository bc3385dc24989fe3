"""Every shipped config and example plan loads, validates, and round-trips exactly through YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runtime.torchfree.spec import Cluster, ModelSpec, Plan, load_plan_context
from runtime.torchfree.spec.io import dump_yaml, read_yaml
from runtime.torchfree.spec.schema import build, to_data

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
KINDS = {"models": ModelSpec, "clusters": Cluster, "plans": Plan}
FILES = [(kind, p) for kind in KINDS for p in sorted((CONFIGS / kind).glob("*.yaml"))]


def test_catalog_has_required_entries():
    names = {kind: {p.stem for k, p in FILES if k == kind} for kind in KINDS}
    assert {"llama-7b", "llama-13b", "llama-32b", "llama-70b", "llama-tiny"} <= names["models"]
    assert {"h800-h20-48", "h20-32", "h2-example", "hexiscale-mixed", "cpu-hetero4"} <= names["clusters"]


@pytest.mark.parametrize("kind,path", FILES, ids=[f"{k}/{p.name}" for k, p in FILES])
def test_roundtrip(kind: str, path: Path):
    cls = KINDS[kind]
    obj = build(cls, read_yaml(path), str(path))
    text = dump_yaml(to_data(obj))
    again = build(cls, yaml.safe_load(text), "roundtrip")
    assert again == obj
    assert dump_yaml(to_data(again)) == text


@pytest.mark.parametrize("path", [p for k, p in FILES if k == "plans"], ids=lambda p: p.name)
def test_example_plans_validate(path: Path):
    ctx = load_plan_context(path)
    assert ctx.plan.strategies


def test_cluster_shapes():
    from runtime.torchfree.spec import load_cluster

    paper = load_cluster("h800-h20-48")
    assert paper.num_devices == 48
    assert len(paper.devices_of_type("H800")) == 16 and len(paper.devices_of_type("H20")) == 32
    h2 = load_cluster("h2-example")
    assert len(h2.devices_of_type("chip-a")) == 16 and len(h2.devices_of_type("chip-b")) == 4
    hexi = load_cluster("hexiscale-mixed")
    assert [len(hexi.devices_of_type(t)) for t in ("A800", "RTX4090", "RTX3090")] == [3, 3, 2]
    cpu = load_cluster("cpu-hetero4")
    assert cpu.emulated and cpu.num_devices == 4
    assert [cpu.type_of(d).emulate.slowdown for d in range(4)] == [1.0, 1.0, 3.0, 3.0]
    assert load_cluster("h20-32").num_devices == 32


def test_bandwidth_model():
    from runtime.torchfree.spec import load_cluster

    c = load_cluster("h800-h20-48")
    assert c.bandwidth_gbs(0, 1) == 200  # H800 NVLink
    assert c.bandwidth_gbs(16, 17) == 450  # H20 NVLink
    assert c.bandwidth_gbs(0, 16) == 50  # across nodes
    m = [[c.bandwidth_gbs(i, j) for j in range(c.num_devices)] for i in range(c.num_devices)]
    assert len(m) == 48 and m[3][40] == m[40][3]

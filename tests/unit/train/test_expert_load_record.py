"""A MoE step's record: the expert loads its workers report, each router taken once (its holders report the
same sums), summed over the MoE layers, and the worst layer's most loaded expert against its layer's mean."""

from __future__ import annotations

import pytest

from runtime.launch import StepRecord, StepReport


def report(rank: int, loads: dict | None) -> StepReport:
    return StepReport(step=1, rank=rank, device=rank, loss=2.0, grad_norm=1.0, tokens=64, wall_s=1.0,
                      compute_s=0.5, comm_s=0.1, emulation_s=0.0, expert_loads=loads)


def test_each_router_counts_once_and_layers_add_up():
    layer1 = {"model.layers.1.mlp.gate.expert_bias": (10.0, 2.0, 2.0, 2.0)}
    layer2 = {"model.layers.2.mlp.gate.expert_bias": (4.0, 4.0, 4.0, 4.0)}
    # ranks 0 and 1 share layer 1 (TP or EP ranks: the same sums), rank 2 holds layer 2, rank 3 no MoE layer
    r = StepRecord.combine([report(0, layer1), report(1, layer1), report(2, layer2), report(3, {})], "s")
    assert r.expert_load == [14.0, 6.0, 6.0, 6.0]
    assert r.expert_load_max_over_mean == pytest.approx(10.0 / 4.0)
    assert r.to_json()["expert_load"] == [14.0, 6.0, 6.0, 6.0]


def test_a_dense_model_s_record_has_no_expert_load():
    r = StepRecord.combine([report(0, None), report(1, None)], "s")
    assert r.expert_load is None and "expert_load" not in r.to_json()

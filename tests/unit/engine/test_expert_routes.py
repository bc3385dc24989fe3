"""The expert exchange's pure rules: which holder each source sends to, and which pairs a capacity keeps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.expert_parallel import ExpertRoutes, kept_pairs


def test_each_source_sends_an_expert_to_one_of_its_holders_and_replicas_share_the_sources() -> None:
    routes = ExpertRoutes(((0, 1, 2), (3,), (4, 5), (6, 7, 4)), 8)
    assert routes.holders(4) == (2, 3) and routes.holders(3) == (1,)
    assert [routes.dest(s, 4) for s in range(4)] == [2, 3, 2, 3]   # source s to holder s mod 2
    assert {routes.dest(s, 0) for s in range(4)} == {0}
    with pytest.raises(ValueError, match=r"experts \[5\] have no holder"):
        ExpertRoutes(((0, 1, 2, 3, 4), (6, 7)), 8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3), min_size=1, max_size=5),
       st.one_of(st.none(), st.integers(0, 30)))
def test_a_capacity_keeps_each_experts_first_pairs_in_source_order(rows: list[list[int]], capacity: int | None) -> None:
    counts = torch.tensor(rows)
    kept = kept_pairs(counts, capacity)
    assert bool((kept >= 0).all()) and bool((kept <= counts).all())
    if capacity is None:
        assert torch.equal(kept, counts)
        return
    for e in range(counts.shape[1]):
        col, got = counts[:, e].tolist(), kept[:, e].tolist()
        left = capacity
        for c, k in zip(col, got):   # greedy in source order: as the single device keeps token order
            assert k == min(c, left)
            left -= k

"""The annotation algebra: validation, normalisation, regions, global/local views, DTensor placements."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import global_view, local_view, to_placements

from runtime.torchfree.annotations import Annotation, DeviceGroup, DistributedStates, DSUnion, LayoutError, lcm_degrees

S = DistributedStates


def test_states_normalise_and_compare():
    assert S.of({0: 2, -1: 1}) == S.split(0, 2)
    assert S.of({0: 2, 1: 2}, order=(0, 1)) != S.of({0: 2, 1: 2}, order=(1, 0))
    assert S.of({0: 2, 1: 1}, order=(1, 0)).order == (0,)
    assert S.of().device_num == 1 and str(S.of()) == "full"
    assert str(S.of({-1: 2, 1: 3}, order=(-1, 1))) == "D×2·S1×3"


@pytest.mark.parametrize("states, order, message", [
    ({0: 2, 1: 2}, (), "give an explicit order"),
    ({0: 0}, (), "degrees must be at least 1"),
    ({-3: 2}, (), "not a tensor dim"),
    ({0: 2, 1: 2}, (0,), "does not list dims [1]"),
    ({0: 2}, (0, 0), "lists a dim twice"),
    ({0: 2}, (1,), "no degree"),
])
def test_states_reject(states, order, message):
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        S.of(states, order)


def index_of(ds: DistributedStates, coords: dict[int, int]) -> int:
    """The inverse of ``coordinates``: the position in the group of the device at ``coords``."""
    idx = 0
    for dim in ds.order:
        idx = idx * ds.degree(dim) + coords.get(dim, 0)
    return idx


def test_coordinates_last_dim_fastest():
    ds = S.of({0: 2, -1: 3}, order=(0, -1))
    assert [ds.coordinates(i) for i in range(6)][:4] == [{0: 0, -1: 0}, {0: 0, -1: 1}, {0: 0, -1: 2}, {0: 1, -1: 0}]
    ds2 = S.of({0: 2, -1: 3}, order=(-1, 0))
    assert ds2.coordinates(1) == {-1: 0, 0: 1}
    assert all(index_of(ds, ds.coordinates(i)) == i for i in range(6))


def test_union_validation_and_normalisation():
    with pytest.raises(LayoutError, match="give the split weights explicitly"):
        DSUnion(0, (S.of(), S.of()))
    with pytest.raises(LayoutError, match="one entry per subgroup"):
        DSUnion(0, (S.of(), S.of()), (1, 2, 3))
    with pytest.raises(LayoutError, match="only apply to hdim >= 0"):
        DSUnion(-1, (S.of(), S.of()), (1, 1))
    assert DSUnion(0, (S.of(), S.of()), (6, 2)) == DSUnion(0, (S.of(), S.of()), (3, 1))
    # One subgroup: plain SPMD, the top tier is meaningless and dropped.
    assert DSUnion(0, (S.of(),), (5,)) == DSUnion(-2, (S.of(),))
    with pytest.raises(LayoutError, match="more than one subgroup"):
        Annotation.union(-1, [((0, 1), S.duplicate(2)), ((1,), S.of())])
    with pytest.raises(LayoutError, match="need 2 devices"):
        Annotation.union(-1, [((0, 1, 2), S.duplicate(2))])
    with pytest.raises(LayoutError, match="more than once"):
        DeviceGroup((1, 1))


def test_shape_checks():
    a = Annotation.union(0, [((0, 1), S.split(0, 2)), ((2,), S.of())], (1, 1))
    a.check((8, 3))
    with pytest.raises(LayoutError, match="not divisible"):
        a.check((6, 3))  # member 0 gets 3 rows, split 2 ways
    with pytest.raises(LayoutError, match="empty part"):
        Annotation.union(0, [((0,), S.of()), ((1,), S.of())], (1, 3)).check((2,))
    with pytest.raises(LayoutError, match="out of range"):
        Annotation.spmd([0, 1], S.split(2, 2)).check((4, 4))


def test_uneven_top_split_regions():
    # Batch of 8 across two pipelines weighted 6:2; inside the first, a TP-2 group duplicates it.
    a = Annotation.union(0, [((0, 1), S.duplicate(2)), ((5,), S.of())], (6, 2))
    lay = a.layout((8, 4))
    assert lay.region(0) == lay.region(1) == ((0, 6), (0, 4))
    assert lay.region(5) == ((6, 8), (0, 4))
    # Uneven weights that do not divide: floor of the prefix sums, deterministic, covering the dim.
    b = Annotation.union(0, [((0,), S.of()), ((1,), S.of()), ((2,), S.of())], (1, 1, 1)).layout((7,))
    assert [b.region(d) for d in (0, 1, 2)] == [((0, 2),), ((2, 4),), ((4, 7),)]


def test_partial_and_replica_marks():
    a = Annotation.union(-2, [((0, 1), S.duplicate(2)), ((2, 3), S.of({-2: 2}))])
    lay = a.layout((4,))
    h = lay.by_device
    assert (h[0].summand, h[0].replica) == ((0, 0), 0)
    assert (h[1].summand, h[1].replica) == ((0, 0), 1)  # a replica of member 0's summand: counts once
    assert h[2].summand == (1, 0) and h[3].summand == (1, 1)
    assert lay.is_partial and not lay.reduced().is_partial


def test_global_view_counts_member_once():
    a = Annotation.union(-2, [((0, 1), S.duplicate(2)), ((2,), S.of())])
    lay = a.layout((3,))
    ga, gb = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])
    assert torch.equal(global_view(lay, {0: ga, 1: ga, 2: gb}), ga + gb)


def test_global_view_split_top_with_partial_member():
    # Member 0 holds rows 0-1 whole, member 1 holds rows 2-3 as two summands.
    a = Annotation.union(0, [((0,), S.of()), ((1, 2), S.partial(2))], (1, 1))
    lay = a.layout((4,))
    got = global_view(lay, {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, 4.0]), 2: torch.tensor([10.0, 20.0])})
    assert torch.equal(got, torch.tensor([1.0, 2.0, 13.0, 24.0]))


def test_grad_annotation():
    p = Annotation.union(-1, [((0, 1), S.split(1, 2)), ((2,), S.of())])
    g = p.with_hdim(-2)
    assert g.grad() == p
    mixed = Annotation.spmd(range(4), S.of({-2: 2, -1: 2}, order=(-2, -1)))
    assert mixed.grad() == Annotation.spmd(range(4), S.duplicate(4))
    apart = Annotation.spmd(range(8), S.of({-2: 2, 0: 2, -1: 2}, order=(-2, 0, -1)))
    with pytest.raises(LayoutError, match="not adjacent"):
        apart.grad()
    # The layout still describes it: devices differing only in partial/duplicate coordinates agree.
    red = apart.layout((4,)).reduced()
    assert red.region(0) == red.region(1) == red.region(4) == red.region(5) == ((0, 2),)


def test_lcm_not_max():
    a = Annotation.spmd([0, 1], S.split(0, 2))
    b = Annotation.spmd([2, 3, 4], S.split(0, 3))
    assert lcm_degrees([a, b], 0) == 6


def test_to_placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    shape, placements = to_placements(S.of({-1: 2, 1: 3, -2: 2}, order=(-2, 1, -1)))
    assert shape == (2, 3, 2)
    assert placements == (Partial("sum"), Shard(1), Replicate())
    assert to_placements(S.of()) == ((1,), (Replicate(),))


# --- properties ---------------------------------------------------------------------------------

@st.composite
def spmd_layouts(draw):
    rank = draw(st.integers(1, 3))
    dims = draw(st.lists(st.sampled_from(list(range(rank)) + [-1]), min_size=0, max_size=3, unique=True))
    degrees = {d: draw(st.integers(2, 3)) for d in dims}
    order = draw(st.permutations(dims))
    ds = S.of(degrees, order)
    shape = tuple(6 * draw(st.integers(1, 2)) for _ in range(rank))
    devices = draw(st.permutations(list(range(20, 20 + ds.device_num))))
    return Annotation.spmd(devices, ds), shape


@settings(max_examples=60, deadline=None)
@given(spmd_layouts())
def test_regions_tile_tensor_dup_times(case):
    ann, shape = case
    lay = ann.layout(shape)
    ds = ann.ds.states[0]
    count = torch.zeros(shape, dtype=torch.int64)
    for d in lay.devices:
        count[tuple(slice(a, b) for a, b in lay.region(d))] += 1
    assert bool((count == ds.degree(-1)).all())
    for d in lay.devices:
        assert math.prod(lay.local_shape(d)) * ds.device_num == math.prod(shape) * ds.degree(-1)
    full = torch.arange(math.prod(shape)).view(shape)
    assert torch.equal(global_view(lay, {d: local_view(lay, full, d) for d in lay.devices}), full)

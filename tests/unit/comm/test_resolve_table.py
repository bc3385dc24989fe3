"""The resolution table of docs/design.md §3: every (src, dst) pattern and the op it becomes."""

from __future__ import annotations

import pytest

from runtime.torchfree.annotations import Annotation, DistributedStates, LayoutError
from runtime.torchfree.comm.resolve import KINDS, resolve
from runtime.torchfree.errors import HspmdError

S = DistributedStates
spmd = Annotation.spmd
union = Annotation.union

# (case, src, dst, shape, kind, parts, adjoint kind)
TABLE = [
    ("same annotation", spmd([0, 1], S.split(0, 2)), spmd([0, 1], S.split(0, 2)), (4, 2), "identity", (),
     "identity"),
    ("same data, other words", union(-1, [((0,), S.of())]), spmd([0]), (4,), "identity", (), "identity"),
    ("dup -> split", spmd([0, 1]), spmd([0, 1], S.split(0, 2)), (4,), "local_slice", (), "all_gather"),
    ("dup -> split x dup", spmd(range(4)), spmd(range(4), S.of({0: 2, -1: 2}, (0, -1))), (4,), "local_slice", (),
     "all_gather"),
    ("partial -> dup", spmd([0, 1], S.partial(2)), spmd([0, 1]), (4,), "all_reduce", (), "identity"),
    ("split -> dup", spmd([0, 1], S.split(0, 2)), spmd([0, 1]), (4,), "all_gather", (), "local_slice"),
    ("split 2d -> split one dim", spmd(range(4), S.of({0: 2, 1: 2}, (0, 1))),
     spmd(range(4), S.of({-1: 2, 1: 2}, (-1, 1))), (4, 4), "all_gather", (), "local_slice"),
    ("partial -> split", spmd([0, 1], S.partial(2)), spmd([0, 1], S.split(1, 2)), (2, 4), "reduce_scatter", (),
     "all_gather"),
    ("one device -> split", spmd([3]), spmd([1, 3, 5], S.split(0, 3)), (6,), "scatter", (), "bsr"),
    ("stage boundary, same TP", spmd([0, 1]), spmd([2, 3]), (2, 3), "send_recv", (), "send_recv"),
    ("stage boundary, split", spmd([0, 1], S.split(1, 2)), spmd([4, 5], S.split(1, 2)), (2, 4), "send_recv", (),
     "send_recv"),
    ("partial moves whole", spmd([0, 1], S.partial(2)), spmd([2, 3], S.partial(2)), (4,), "send_recv", (),
     "send_recv"),
    ("grad sync, TP 4 vs TP 2 (paper)", union(-2, [((0, 1, 2, 3), S.split(1, 4)), ((8, 9), S.split(1, 2))]),
     union(-1, [((0, 1, 2, 3), S.split(1, 4)), ((8, 9), S.split(1, 2))]), (4, 8), "split_all_reduce", (),
     "identity"),
    ("grad sync, norm dup in TP group", union(-2, [((0, 1), S.duplicate(2)), ((2,), S.of())]),
     union(-1, [((0, 1), S.duplicate(2)), ((2,), S.of())]), (8,), "split_all_reduce", (), "identity"),
    ("partial -> batch split", union(-2, [((0,), S.of()), ((1,), S.of())]),
     union(0, [((0,), S.of()), ((1,), S.of())], (1, 1)), (4, 2), "split_reduce_scatter", (), "split_all_gather"),
    ("batch split -> dup", union(0, [((0, 1), S.split(1, 2)), ((2, 3), S.split(1, 2))], (1, 1)),
     union(-1, [((0, 1), S.split(1, 2)), ((2, 3), S.split(1, 2))]), (4, 4), "split_all_gather", (), "local_slice"),
    ("grad sync then gather", union(-2, [((0, 1, 2, 3), S.split(1, 4)), ((8, 9), S.split(1, 2))]),
     union(-1, [((0, 1, 2, 3), S.duplicate(4)), ((8, 9), S.duplicate(2))]), (2, 8), "composed",
     ("split_all_reduce", "all_gather"), "local_slice"),
    ("reduce then move", spmd([0, 1], S.partial(2)), spmd([2, 3], S.split(0, 2)), (4,), "composed",
     ("all_reduce", "bsr"), "bsr"),
    ("TP 2 -> TP 3", spmd([0, 1], S.split(0, 2)), spmd([2, 3, 4], S.split(0, 3)), (6,), "bsr", (), "bsr"),
    ("two pipelines -> one group", union(-1, [((0, 1), S.split(0, 2)), ((2,), S.of())]),
     spmd([3, 4, 5], S.split(0, 3)), (6, 2), "bsr", (), "bsr"),
    ("uneven batch re-split", union(0, [((0,), S.of()), ((1,), S.of())], (1, 1)),
     union(0, [((0,), S.of()), ((1,), S.of())], (3, 1)), (8,), "bsr", (), "bsr"),
    ("order change is a reshuffle", spmd(range(4), S.of({0: 2, 1: 2}, (0, 1))),
     spmd(range(4), S.of({0: 2, 1: 2}, (1, 0))), (4, 4), "bsr", (), "bsr"),
]


@pytest.mark.parametrize("case, src, dst, shape, kind, parts, adjoint", TABLE, ids=[t[0] for t in TABLE])
def test_resolution_table(case, src, dst, shape, kind, parts, adjoint):
    op = resolve(src, dst, shape)
    assert op.kind == kind, op.describe()
    assert op.parts == parts
    assert op.adjoint.kind == adjoint, op.adjoint.describe()
    assert op.kind in KINDS


def test_every_kind_is_in_the_table():
    assert {t[4] for t in TABLE} == set(KINDS)


def test_paper_split_all_reduce_groups():
    # docs/design.md §2: TP 4 on 0-3 and TP 2 on 8-9, split dim 1: LCM 4 slices, each all-reduced by its holders.
    members = [((0, 1, 2, 3), S.split(1, 4)), ((8, 9), S.split(1, 2))]
    op = resolve(union(-2, members), union(-1, members), (6, 8))
    assert op.groups() == [(0, 8), (1, 8), (2, 9), (3, 9)]
    assert [b.regions for b in op.reduce] == [(((0, 6), (c, c + 2)),) for c in (0, 2, 4, 6)]
    assert not op.p2p.transfers and op.p2p_only is False


def test_duplicate_member_contributes_once():
    members = [((0, 1), S.duplicate(2)), ((2,), S.of())]
    op = resolve(union(-2, members), union(-1, members), (8,))
    assert op.groups() == [(0, 1, 2)]
    reps = {d: h.replica for d, h in op.src.holdings}
    assert reps == {0: 0, 1: 1, 2: 0}  # device 1 sends zeros: g_A + g_B, not 2 g_A + g_B


def test_reduce_scatter_needers():
    op = resolve(spmd([0, 1], S.partial(2)), spmd([0, 1], S.split(0, 2)), (6,))
    (b,) = op.reduce
    assert b.devices == (0, 1) and b.needers == (0, 1) and b.regions == (((0, 3),), ((3, 6),))


def test_bsr_pieces_lcm():
    op = resolve(spmd([0, 1], S.split(0, 2)), spmd([2, 3, 4], S.split(0, 3)), (6,))
    got = sorted((t.src, t.dst, t.region) for t in op.p2p.transfers)
    assert got == [(0, 2, ((0, 2),)), (0, 3, ((2, 3),)), (1, 3, ((3, 4),)), (1, 4, ((4, 6),))]
    assert [m.peer for m in op.sends(0)] == [2, 3] and op.recvs(3)[1].peer == 1
    assert op.p2p.total_bytes == 6 * 4


def test_local_part_is_copied_not_sent():
    op = resolve(spmd([0, 1], S.split(0, 2)), spmd([0, 1, 2], S.split(0, 3)), (6,))
    assert {(c.device, c.region) for c in op.p2p.local} == {(0, ((0, 2),)), (1, ((3, 4),))}
    assert sorted((t.src, t.dst, t.region) for t in op.p2p.transfers) == [
        (0, 1, ((2, 3),)), (1, 2, ((4, 6),))]


def test_send_recv_is_positional():
    op = resolve(spmd([0, 1]), spmd([5, 4]), (3,))
    assert sorted((t.src, t.dst) for t in op.p2p.transfers) == [(0, 5), (1, 4)]
    assert sorted((t.src, t.dst) for t in op.adjoint.p2p.transfers) == [(4, 1), (5, 0)]


@pytest.mark.parametrize("src, dst, shape, error, message", [
    (spmd([0, 1]), spmd([0, 1], S.partial(2)), (4,), HspmdError, "partial destination"),
    (spmd([0, 1], S.split(0, 2)), spmd([0, 1, 2], S.split(0, 3)), (4,), LayoutError, "not divisible"),
    (spmd([0]), spmd([1]), (0,), LayoutError, "empty dim"),
])
def test_resolution_errors(src, dst, shape, error, message):
    with pytest.raises(error, match=message):
        resolve(src, dst, shape)

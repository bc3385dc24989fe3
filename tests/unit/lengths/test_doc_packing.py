"""Packing whole documents into micro-batch rows: boundaries, restarting positions, labels inside documents."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.documents import IGNORE_INDEX, pack, pack_rows

X = IGNORE_INDEX


def test_pack_by_hand():
    docs = [[10, 11, 12], [20, 21], [30], [40, 41, 42, 43]]
    b = pack(docs, row_len=4, pad_id=0)
    # first-fit decreasing: [40..43] | [10,11,12] + [30] | [20,21]
    assert [r.documents for r in b.rows] == [(3,), (0, 2), (1,)]
    r0, r1, r2 = b.rows
    assert r0.tokens == (40, 41, 42, 43) and r0.labels == (41, 42, 43, X) and r0.cu_seqlens == (0, 4)
    assert r1.tokens == (10, 11, 12, 30) and r1.labels == (11, 12, X, X)
    assert r1.positions == (0, 1, 2, 0) and r1.cu_seqlens == (0, 3, 4) and r1.segment_ids() == (0, 0, 0, 1)
    assert r2.tokens == (20, 21, 0, 0) and r2.labels == (21, X, X, X) and r2.positions == (0, 1, 0, 0)
    assert r2.cu_seqlens == (0, 2) and r2.segment_ids() == (0, 0, -1, -1)
    assert (b.num_tokens, b.num_labels, b.padding) == (10, 6, 2)


def test_pack_one_varlen_row_keeps_input_order():
    b = pack([[1, 2], [3], [4, 5, 6]])
    (r,) = b.rows
    assert b.row_len == 6 and b.padding == 0
    assert r.tokens == (1, 2, 3, 4, 5, 6) and r.cu_seqlens == (0, 2, 3, 6) and r.positions == (0, 1, 0, 0, 1, 2)
    assert r.labels == (2, X, X, 5, 6, X)
    assert pack([]).rows == ()


def test_pack_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="document 1: length 5 outside 1..row_len 4"):
        pack([[1], [1, 2, 3, 4, 5]], row_len=4)
    with pytest.raises(ValueError, match="document 0: length 0"):
        pack_rows([0], 4)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), row_len=st.integers(1, 40), varlen=st.booleans())
def test_labels_never_cross_a_document(data, row_len, varlen):
    docs = data.draw(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=row_len), max_size=25))
    b = pack(docs, None if varlen else row_len, pad_id=7)
    seen = sorted(i for r in b.rows for i in r.documents)
    assert seen == list(range(len(docs)))          # every document exactly once, never split
    for r in b.rows:
        assert len(r.tokens) == len(r.labels) == len(r.positions) == b.row_len
        assert r.cu_seqlens[0] == 0 and list(r.cu_seqlens) == sorted(r.cu_seqlens)
        seg = r.segment_ids()
        for i, d in enumerate(r.documents):
            lo, hi = r.cu_seqlens[i], r.cu_seqlens[i + 1]
            assert list(r.tokens[lo:hi]) == docs[d]
            assert list(r.positions[lo:hi]) == list(range(hi - lo))
        for t, label in enumerate(r.labels):
            if label != IGNORE_INDEX:
                # the label is the next token of the same document
                assert seg[t] == seg[t + 1] != -1 and label == r.tokens[t + 1]
            else:
                assert t + 1 >= len(r.tokens) or seg[t] != seg[t + 1] or seg[t] == -1
        assert all(tok == 7 for tok, s in zip(r.tokens, seg) if s == -1)
    assert b.num_labels == sum(len(d) - 1 for d in docs)
    assert b.num_tokens == sum(len(d) for d in docs)
    assert b == pack(docs, None if varlen else row_len, pad_id=7)

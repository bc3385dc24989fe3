"""Packed documents through the plain model compute exactly what each document alone computes: attention
block-diagonal causal, RoPE positions restarting per document, no label across a boundary."""

from __future__ import annotations

import pytest
import torch

from runtime.documents import IGNORE_INDEX, Document, StepDocuments
from runtime.engine.microbatch import MicroBatch, documents_step_batch, packed_micro_batch, window_micro_batch
from runtime.models.attention import document_mask
from runtime.models.llama import LlamaForCausalLM, causal_lm_loss_sum
from runtime.torchfree.spec import load_model

MODEL = load_model("llama-tiny")


def docs_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_mask_is_block_diagonal_causal():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = document_mask(seg)[0, 0]
    want = torch.zeros(6, 6, dtype=torch.bool)
    for block in ((0, 2), (2, 5), (5, 6)):
        a, b = block
        want[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(m, want)


@pytest.mark.parametrize("lengths", [(5, 1, 9), (16,), (3, 3, 3, 7)])
def test_packed_forward_and_grads_equal_each_document_alone(lengths):
    torch.manual_seed(0)
    model = LlamaForCausalLM(MODEL)
    model.init_weights(3)
    docs = docs_of(lengths)
    mb = packed_micro_batch(docs)
    assert mb.shape == (1, sum(lengths))
    assert mb.num_labels == sum(n - 1 for n in lengths)
    packed = model(mb.tokens, mb.positions, mb.segments)
    loss = causal_lm_loss_sum(packed, mb.labels)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone_loss = torch.zeros(())
    offset = 0
    for d in docs:
        x = torch.tensor(d).unsqueeze(0)
        out = model(x)
        torch.testing.assert_close(packed[:, offset:offset + len(d)], out, rtol=1e-5, atol=1e-5)
        offset += len(d)
        if len(d) > 1:
            alone_loss = alone_loss + causal_lm_loss_sum(out[:, :-1], x[:, 1:])
    alone_loss.backward()
    torch.testing.assert_close(loss, alone_loss, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_labels_never_cross_a_document():
    mb = packed_micro_batch([[1, 2, 3], [4, 5]])
    assert mb.labels.tolist() == [[2, 3, IGNORE_INDEX, 5, IGNORE_INDEX]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.segments.tolist() == [[0, 0, 0, 1, 1]]


def test_window_micro_batch_is_the_old_form():
    rows = torch.arange(12).view(2, 6)
    mb = window_micro_batch(rows)
    assert mb.shape == (2, 5) and mb.positions is None and mb.segments is None
    assert torch.equal(mb.labels, rows[:, 1:])


def test_step_batch_places_every_document_once():
    docs = StepDocuments(1, tuple(Document(tuple(d), "t") for d in docs_of((4, 2, 3))))
    sb = documents_step_batch(docs, [[[0, 2]], [], [[1]]])
    assert [[m.shape for m in p] for p in sb.pipelines] == [[(1, 7)], [], [(1, 2)]]
    assert sb.num_labels == 6 and sb.num_tokens == 9
    with pytest.raises(ValueError):
        documents_step_batch(docs, [[[0, 2]], [[2]], [[1]]])
    with pytest.raises(ValueError):
        MicroBatch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_flex_document_kernel_equals_the_masked_reference(heads, kv_heads):
    """The CUDA kernel (FlexAttention over the document block mask, run here by torch's eager
    implementation, forward only) computes what the boolean-mask reference computes, GQA included, for
    rows of several documents, padding, and documents that straddle a 128-token tile."""
    from runtime.models.attention import flex_document_attention, masked_document_attention

    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    s, d = 300, 16
    segments = torch.tensor([[0] * 100 + [1] * 150 + [-1] * 50, [3] * 7 + [4] * 293])
    q = torch.randn(2, heads, s, d, generator=g)
    k, v = (torch.randn(2, kv_heads, s, d, generator=g) for _ in range(2))
    with torch.no_grad():
        got = flex_document_attention(segments, compiled=False)(q, k, v)
    torch.testing.assert_close(got, masked_document_attention(segments)(q, k, v), rtol=1e-5, atol=1e-5)


def test_expanded_kv_is_what_gqa_computes():
    """The fp32 CUDA window path expands K/V instead of passing enable_gqa: the same attention."""
    import torch.nn.functional as F

    from runtime.models.attention import expand_kv

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 20, 16, generator=g)
    k, v = (torch.randn(2, 2, 20, 16, generator=g) for _ in range(2))
    ek, ev = expand_kv(k, v, 8)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, ek, ev, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

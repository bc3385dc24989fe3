"""Causal self-attention kernels: one causal sequence per row, or rows of packed documents.

A row of packed documents attends block-diagonally: token t sees token u iff both belong to the same
document and u <= t. Which kernel computes that depends on the device:

* CUDA: FlexAttention with a document block mask, both compiled (``torch.compile``). The block mask
  stores, per 128 x 128 tile, whether the tile is empty, full or partial, so the fused kernel skips the
  tiles between documents and never forms an s x s score or mask tensor; it takes grouped-query K/V
  as they are (``enable_gqa``). SDPA cannot serve here: a boolean mask rules out flash attention, and
  a mask with GQA selects the math kernel, which keeps [batch, heads, s, s] fp32 scores (about 34 GB
  per call at 32K tokens and 8 heads). Expanding K/V would let the memory-efficient kernel take the
  mask, but the mask itself would still be s x s.
* CPU: SDPA with the boolean mask. FlexAttention has no backward on CPU, and the CPU runs the test
  harness and the reference, whose rows are short.

One sequence per row (no documents) is SDPA with ``is_causal``, which selects flash attention on CUDA
for bf16/fp16 with or without GQA; in fp32 on CUDA, GQA's K/V are expanded so that the memory-efficient
kernel applies (flash needs fp16/bf16, and the math kernel would keep s x s scores).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> out, [b, h, s, d]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and not _half_precision(q):
        # Flash attention is CUDA's only SDPA kernel that takes GQA, and it needs fp16/bf16: in fp32 the math
        # kernel would keep s x s scores. K/V expanded to the query heads let the memory-efficient one run.
        k, v = expand_kv(k, v, q.shape[1])
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of [b, kv_heads, s, d] repeated to ``heads`` heads as GQA pairs them: query head i reads KV head
    i // (heads / kv_heads)."""
    rep = heads // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _half_precision(q: torch.Tensor) -> bool:
    """Whether SDPA will see ``q`` in fp16/bf16 (autocast casts its inputs inside the op)."""
    return q.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(q.device.type)


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed documents, [batch, 1, seq, seq] bool (True: may attend):
    token t sees token u iff both carry the same document id in ``segments`` [batch, seq] and u <= t.
    Padding shares one id (-1) and so only sees padding: no row is ever fully masked."""
    seq = segments.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    return (segments.unsqueeze(-1) == segments.unsqueeze(-2)).logical_and(causal).unsqueeze(1)


def masked_document_attention(segments: torch.Tensor) -> Attend:
    """SDPA with the full boolean mask (the CPU path; see the module docstring)."""
    mask = document_mask(segments)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def document_block_mask(segments: torch.Tensor, *, compiled: bool):  # -> flex_attention.BlockMask
    """The FlexAttention block mask of packed rows ``segments`` [batch, seq] (one per forward, shared by
    every layer). Compiled, its construction never forms the [batch, seq, seq] boolean tensor."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (segments[b, q_idx] == segments[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seq = segments.shape
    make = _compiled(create_block_mask) if compiled else create_block_mask
    return make(same_document_causal, batch, None, seq, seq, device=segments.device)


def flex_document_attention(segments: torch.Tensor, *, compiled: bool = True) -> Attend:
    """FlexAttention over the document block mask (the CUDA path). ``compiled=False`` runs torch's eager
    implementation, which materialises the scores: for checking the numbers on CPU, forward only."""
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = document_block_mask(segments, compiled=compiled)
    kernel = _compiled(flex_attention) if compiled else flex_attention

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # SDPA runs in autocast's lower precision; FlexAttention is not an autocast op: q and k leave RoPE in
        # the residual stream's dtype (fp32) while v comes straight from its projection, so all three take
        # v's dtype (bf16 under autocast, as SDPA would cast them).
        dtype = v.dtype
        return kernel(q.to(dtype), k.to(dtype), v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def document_attention(segments: torch.Tensor) -> Attend:
    """The packed-document kernel for ``segments``' device (the module docstring says why each)."""
    if segments.device.type == "cuda":
        return flex_document_attention(segments)
    return masked_document_attention(segments)


@cache
def _compiled(fn: Callable) -> Callable:
    # One compiled function per kernel for the process: torch.compile caches its graphs on that object, and
    # a sequence length it has not seen recompiles once with dynamic shapes rather than per length.
    return torch.compile(fn)

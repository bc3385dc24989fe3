"""A plain PyTorch Llama decoder with Hugging Face parameter names.

Parallelism is never written into this file: a pipeline stage is the same class built with a layer
range and without the embedding or head, and TP sharding is applied from outside (the runtime swaps
weights for DTensor shards). Attention therefore infers its local head count from the projection
shapes. Layers are kept in a ModuleDict keyed by their global index, so a stage's parameter names are
exactly the full model's (``model.layers.7.mlp.up_proj.weight``) and checkpoints are plan-independent.

With tied embeddings the head is an ``nn.Linear`` whose weight *is* the embedding's parameter; a head
stage that does not embed still holds ``model.embed_tokens`` (never called) so that the one weight keeps
its one name on every stage.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.attention import Attend, causal_attention, document_attention
from runtime.torchfree.spec.model import ModelSpec, RopeScaling

INIT_STD = 0.02


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    # Each parameter's initial value depends only on (seed, its name): every plan, whatever subset of
    # the model a device builds, starts from the same weights as the single-device reference.
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                     device: torch.device) -> torch.Tensor:
    """Inverse frequencies of the head_dim / 2 rotary pairs (fp32), rescaled as Llama 3.x does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.x, compared by wavelength (2 pi / frequency) against the original context as transformers
    # compares them (so the same pairs fall in each band): wavelengths beyond ctx / low_freq_factor are
    # slowed by ``factor``, those under ctx / high_freq_factor kept, and in between the frequency is
    # blended linearly in ctx / wavelength, from slowed at low_freq_factor to kept at high_freq_factor.
    ctx = scaling.original_max_position_embeddings
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    slow = inv_freq / scaling.factor
    blend = (ctx / wavelength - lo) / (hi - lo)
    between = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    return torch.where(wavelength > ctx / lo, slow, torch.where(wavelength < ctx / hi, inv_freq, between))


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary embeddings, shape [seq_len, head_dim] (HF's rotate-half layout)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def position_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                    scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at explicit ``positions`` [batch, seq] (packed documents restart at 0 each), shape
    [batch, 1, seq, head_dim]: the rows of ``rope_tables`` at those positions, broadcast over heads."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, positions.device)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, q, kv = spec.hidden_size, spec.q_dim, spec.kv_dim
        self.head_dim = spec.head_size
        self.q_proj = nn.Linear(h, q, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend | None = None) -> torch.Tensor:
        """``attend``: the packed-document kernel of this forward (runtime/models/attention.py); None: each
        row is one causal sequence."""
        b, s, _ = x.shape
        # -1: the local head count (all heads, or this TP rank's share of them).
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: each head normalised
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = (attend or causal_attention)(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attn = LlamaAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = LlamaMLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def output_projections(self) -> tuple[nn.Linear, ...]:
        """The projections writing into the residual stream (initialised smaller: ``init_weights``)."""
        return self.self_attn.o_proj, self.mlp.down_proj


class LlamaModel(nn.Module):
    """Embedding (optional), a range of decoder layers, final norm (optional).

    ``hold_embedding``: keep the embedding module without looking tokens up (a tied head's weight)."""

    def __init__(self, spec: ModelSpec, layers: Iterable[int], embed: bool, final_norm: bool,
                 hold_embedding: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.lookup = embed
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size) if embed or hold_embedding else None
        self.layers = nn.ModuleDict({str(i): self.make_layer(spec, i) for i in layers})
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps) if final_norm else None

    def make_layer(self, spec: ModelSpec, layer: int) -> nn.Module:
        """Decoder layer ``layer`` (a MoE model's subclass builds its MoE layers here)."""
        return LlamaDecoderLayer(spec)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` [batch, seq]: RoPE positions (default 0..seq-1 per row); ``segments`` [batch, seq]:
        the document id of every token of packed rows (default: each row one causal sequence)."""
        if self.lookup:
            assert self.embed_tokens is not None
            x = self.embed_tokens(x)
        if positions is None:
            cos, sin = rope_tables(x.shape[1], self.spec.head_size, self.spec.rope_theta, x.device, x.dtype,
                                   self.spec.rope_scaling)
        else:
            cos, sin = position_tables(positions, self.spec.head_size, self.spec.rope_theta, x.dtype,
                                       self.spec.rope_scaling)
        attend = None if segments is None else document_attention(segments)  # one block mask for every layer
        for layer in self.layers.values():
            x = layer(x, cos, sin, attend)
        if self.norm is not None:
            x = self.norm(x)
        return x


class LlamaForCausalLM(nn.Module):
    """The whole model by default; a pipeline stage with ``layers``/``embed``/``head`` set.

    Input: token ids [batch, seq] when ``embed``, else hidden states [batch, seq, hidden]; for packed
    documents also ``positions`` and ``segments`` [batch, seq] (``LlamaModel.forward``).
    Output: logits [batch, seq, vocab] when ``head``, else hidden states.
    """

    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, spec: ModelSpec, layers: Iterable[int] | None = None, *, embed: bool = True,
                 head: bool = True) -> None:
        super().__init__()
        self.spec = spec
        self.layer_ids = tuple(range(spec.num_layers) if layers is None else layers)
        tied = spec.tie_word_embeddings
        self.model = self.make_model(spec, self.layer_ids, embed=embed, final_norm=head, hold_embedding=head and tied)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if head else None
        if self.lm_head is not None and tied:
            assert self.model.embed_tokens is not None
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_model(self, spec: ModelSpec, layers: tuple[int, ...], **kwargs: bool) -> LlamaModel:
        """The decoder body: embedding, ``layers`` and final norm as ``kwargs`` say (``LlamaModel``)."""
        return self.model_class(spec, layers, **kwargs)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        h = self.model(x, positions, segments)
        return self.lm_head(h) if self.lm_head is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int, fill: Fill | None = None) -> None:
        """Deterministic, name-seeded init: N(0, 0.02) for matrices, output projections scaled by
        1/sqrt(2 * num_layers) (GPT-2 style), ones for norms, zeros for biases. A tied head's weight is
        the embedding's and initialised once, under the embedding's name.

        Each parameter's full initial value is made on the CPU, one at a time, and handed to ``fill``
        (default: copied whole into the parameter); a sharded build passes a ``fill`` that keeps this
        rank's part (runtime/engine/build.py), so values never depend on how the model is split."""
        fill = fill or _copy_whole
        out_std = INIT_STD / math.sqrt(2 * self.spec.num_layers)
        cpu = torch.device("cpu")
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                fill(f"{name}.weight", module.weight, torch.ones(module.weight.shape))
            elif module is self.lm_head and self.spec.tie_word_embeddings:
                continue
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if getattr(module, "bias", None) is not None:
                    fill(f"{name}.bias", module.bias, torch.zeros(module.bias.shape))
                full = f"{name}.weight"
                std = out_std if isinstance(module, nn.Linear) and _is_output_projection(self, module) else INIT_STD
                w = module.weight
                g = _generator(seed, full, cpu)
                fill(full, w, torch.randn(w.shape, generator=g, dtype=torch.float32).mul_(std))
        for module in self.modules():   # buffers (an MoE router's), as a module built on meta lacks them
            reset = getattr(module, "reset_buffers", None)
            if reset is not None:
                reset()


Fill = Callable[[str, torch.Tensor, torch.Tensor], None]  # (parameter name, parameter, its full initial value)


def _copy_whole(_name: str, param: torch.Tensor, value: torch.Tensor) -> None:
    param.copy_(value)


def _is_output_projection(model: LlamaForCausalLM, module: nn.Module) -> bool:
    return any(module is p for layer in model.model.layers.values() for p in layer.output_projections())


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies: the runtime divides by the global token count once, so that
    pipelines with different micro-batch counts weight every sample equally."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")

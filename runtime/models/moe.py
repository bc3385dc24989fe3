"""Mixture-of-experts decoder layers for the runtime's Llama (Mixtral, Qwen2-MoE), plain PyTorch.

A MoE layer is the Llama layer with its MLP replaced by a MoE block (``runtime/torchfree/spec/moe.py`` says which
layers): a router scores every expert per token (softmax), the top-k are chosen (on the scores plus a
per-expert bias when DeepSeek-V3's auxiliary-loss-free balancing is on) and weighted by their
probabilities (renormalised to sum 1 when ``norm_topk_prob``); tokens are sorted by expert and each expert
computes its tokens in one GEMM chain (dropless, or the first ``capacity`` tokens in token order under a
capacity factor); shared experts see every token. Parameter names are Hugging Face's for the family
(runtime/torchfree/models/moe_names.py), so checkpoints need no renaming.

The load-balancing loss (Switch Transformer's, normalised to 1 when the load is even) is attached to the
block's output by an identity autograd function whose backward adds its gradient: the loss function and
the pipeline schedule need not know about it, and every micro-batch's router gets its own gradient
whichever order the schedule runs them in. ``MoeForCausalLM.aux_scale`` weighs it against the language
loss (the training loop's share of one micro-batch in the step's loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.attention import Attend
from runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, RMSNorm
from runtime.torchfree.models.moe_names import (
    MOE_NAMES,
    ROUTER,
    ROUTER_BIAS,
    SHARED,
    SHARED_GATE,
    SWIGLU_NAMES,
    MoeNames,
)
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.moe import MoeSpec


class Expert(nn.Module):
    """One SwiGLU expert, its projections named as the family names them (``w1``/``w3``/``w2`` or
    ``gate_proj``/``up_proj``/``down_proj``)."""

    def __init__(self, hidden: int, width: int, names: MoeNames) -> None:
        super().__init__()
        self.names = names
        self.add_module(names.gate, nn.Linear(hidden, width, bias=False))
        self.add_module(names.up, nn.Linear(hidden, width, bias=False))
        self.add_module(names.down, nn.Linear(width, hidden, bias=False))

    @property
    def down(self) -> nn.Linear:
        return getattr(self, self.names.down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = getattr(self, self.names.gate), getattr(self, self.names.up)
        return self.down(F.silu(gate(x)) * up(x))


class Router(nn.Linear):
    """Scores [tokens, experts]. ``expert_bias`` (aux-loss-free balancing) shifts which experts are chosen,
    never their weights. In training ``load`` counts the tokens each expert was given since ``take_load`` (what
    the balancing moves the bias by, and the expert loads a run reports)."""

    def __init__(self, hidden: int, moe: MoeSpec) -> None:
        super().__init__(hidden, moe.num_experts, bias=False)
        self.moe = moe
        self.register_buffer(ROUTER_BIAS, torch.zeros(moe.num_experts), persistent=False)
        # fp64: exact token counts (fp32 is exact only to 2^24, fewer than a large step's routed pairs)
        self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.float64), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The buffers' initial values (a module built on the meta device gets them here, torch's
        ``reset_parameters`` convention for buffers)."""
        self.expert_bias.zero_()
        self.load.zero_()

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities [T, E] fp32, chosen experts [T, k], their weights [T, k] fp32) from the router's
        output ``logits`` [T, E] (the module is called for them: its hooks see the call, as the engine's
        split backward needs)."""
        probs = F.softmax(logits.float(), dim=-1)
        scores = probs + self.expert_bias if self.moe.bias_update_rate > 0 else probs
        chosen = torch.topk(scores, self.moe.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training:
            with torch.no_grad():
                self.load += torch.bincount(chosen.reshape(-1), minlength=self.moe.num_experts).to(self.load.dtype)
        return probs, chosen, weights

    @torch.no_grad()
    def take_load(self) -> torch.Tensor:
        """The tokens per expert counted since the last call (then reset)."""
        load = self.load.clone()
        self.load.zero_()
        return load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update: an expert given more than the mean load gets its bias lowered by the update
        rate, one given less raised. ``load``: tokens per expert over the step, summed over every replica
        of this layer (data-parallel copies route different tokens)."""
        self.expert_bias += self.moe.bias_update_rate * torch.sign(load.mean() - load).to(self.expert_bias.dtype)


class LoadsKept:
    """Whatever runs inside leaves the ``load`` of every router inside ``module`` (a recomputed decoder layer)
    as it found it: activation checkpointing reruns the forward in the backward, routing the same tokens again,
    and must not count them twice. Enterable again after it exits: a split backward may rerun a layer's
    forward once for the input gradient and once for the weight gradient."""

    def __init__(self, module: nn.Module) -> None:
        self.routers = [m for m in module.modules() if isinstance(m, Router)]
        self.saved: list[list[torch.Tensor]] = []

    def __enter__(self) -> LoadsKept:
        self.saved.append([r.load.clone() for r in self.routers])
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for r, before in zip(self.routers, self.saved.pop()):
                r.load.copy_(before)


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, num_experts * sum_e f_e * P_e, with f_e the share of the
    token-to-expert assignments expert e got and P_e its mean router probability: 1 when both are even,
    up to num_experts when one expert takes everything. Only P carries a gradient."""
    counts = torch.bincount(chosen.reshape(-1), minlength=num_experts).to(probs.dtype)
    return num_experts * torch.sum(counts / chosen.numel() * probs.mean(dim=0))


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x``; the backward also sends gradient ``scale`` into ``loss`` (a loss term that
    travels with the activation instead of through the loss function)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


def expert_outputs(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList,
                   capacity: int | None) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * expert(token), for tokens x [T, H]: the (token,
    expert) pairs sorted by expert (stably: token order within an expert), one batch per expert. Under a
    ``capacity`` an expert computes its first ``capacity`` tokens; the others get nothing from it."""
    k = chosen.shape[-1]
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, n in zip(experts, counts):
        take = order[start:start + (n if capacity is None else min(n, capacity))]
        start += n
        if take.numel() == 0:
            continue
        tokens = take // k
        y = expert(x[tokens]) * weights.reshape(-1)[take].unsqueeze(-1)
        out.index_add_(0, tokens, y.to(out.dtype))  # (under autocast the experts compute in bf16)
    return out


class MoeBlock(nn.Module):
    """Router, routed experts and (optionally) shared experts with their gate: [B, S, H] -> [B, S, H]."""

    def __init__(self, spec: ModelSpec, names: MoeNames, experts: tuple[int, ...] | None = None) -> None:
        super().__init__()
        assert spec.moe is not None
        self.moe = spec.moe
        h = spec.hidden_size
        self.add_module(ROUTER, Router(h, spec.moe))
        self.experts: nn.ModuleList | nn.ModuleDict
        width = spec.moe.expert_ffn_size
        if experts is None:
            self.experts = nn.ModuleList(Expert(h, width, names) for _ in range(spec.moe.num_experts))
        else:  # some experts only, under their own indices (the names a full model gives them)
            self.experts = nn.ModuleDict({str(e): Expert(h, width, names) for e in sorted(experts)})
        # Expert parallelism (runtime/engine/expert_parallel.py) replaces how routed tokens reach the experts:
        # a callable (block, tokens [T, H]) -> (routed output [T, H], balance loss). None: all experts here.
        self.exchange: Callable[[MoeBlock, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        if spec.moe.shared_experts:  # under their Hugging Face names (read back by the properties below)
            self.add_module(SHARED, Expert(h, spec.moe.shared_width, SWIGLU_NAMES))
        if spec.moe.shared_gate:
            self.add_module(SHARED_GATE, nn.Linear(h, 1, bias=False))
        self.aux_scale = 1.0
        self.last_balance_loss: torch.Tensor | None = None

    @property
    def router(self) -> Router:
        return getattr(self, ROUTER)

    @property
    def shared(self) -> Expert | None:
        return getattr(self, SHARED, None)

    @property
    def shared_gate(self) -> nn.Linear | None:
        return getattr(self, SHARED_GATE, None)

    def held_experts(self) -> dict[int, Expert]:
        """The routed experts this module holds, by expert index."""
        if isinstance(self.experts, nn.ModuleDict):
            return {int(e): m for e, m in self.experts.items()}  # type: ignore[misc]
        return dict(enumerate(self.experts))  # type: ignore[arg-type]

    def output_projections(self) -> list[nn.Linear]:
        return [e.down for e in self.held_experts().values()] + ([] if self.shared is None else [self.shared.down])

    def routed(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's routed-expert output and the balance loss, all experts here."""
        probs, chosen, weights = self.router.route(self.router(flat))
        out = expert_outputs(flat, chosen, weights, self.experts, self.moe.capacity(flat.shape[0]))
        return out, balance_loss(probs, chosen, self.moe.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        out, loss = self.routed(flat) if self.exchange is None else self.exchange(self, flat)
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        out = out.reshape(b, s, h)
        self.last_balance_loss = loss.detach()  # for logs; kept without its graph (it holds the layer's input)
        if self.moe.aux_loss_coef > 0 and self.training and torch.is_grad_enabled():
            out = _AttachLoss.apply(out, loss, self.moe.aux_loss_coef * self.aux_scale)
        return out


class MoeDecoderLayer(nn.Module):
    """The Llama layer with a MoE block (under the family's name: ``block_sparse_moe`` or ``mlp``)."""

    def __init__(self, spec: ModelSpec, experts: tuple[int, ...] | None = None) -> None:
        super().__init__()
        names = MOE_NAMES[spec.family]
        self.block_name = names.block
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attn = LlamaAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.add_module(names.block, MoeBlock(spec, names, experts))

    @property
    def block(self) -> MoeBlock:
        return getattr(self, self.block_name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.block(self.post_attention_layernorm(x))

    def output_projections(self) -> list[nn.Linear]:
        return [self.self_attn.o_proj, *self.block.output_projections()]


class MoeModel(LlamaModel):
    def __init__(self, spec: ModelSpec, layers: Iterable[int], embed: bool, final_norm: bool,
                 hold_embedding: bool = False, experts: tuple[int, ...] | None = None) -> None:
        self.held = experts   # read by make_layer, which the base class calls
        super().__init__(spec, layers, embed, final_norm, hold_embedding)

    def make_layer(self, spec: ModelSpec, layer: int) -> nn.Module:
        return MoeDecoderLayer(spec, self.held) if spec.is_moe_layer(layer) else LlamaDecoderLayer(spec)


class MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose MoE layers (``spec.moe``) route tokens to experts; a stage, as Llama's,
    with ``layers``/``embed``/``head``, and on an expert-parallel stage with ``experts``: the routed experts
    it holds (the same in each of its MoE layers)."""

    def __init__(self, spec: ModelSpec, layers: Iterable[int] | None = None, *, embed: bool = True,
                 head: bool = True, experts: tuple[int, ...] | None = None) -> None:
        self.held = experts   # read by make_model, which the base class calls
        super().__init__(spec, layers, embed=embed, head=head)

    def make_model(self, spec: ModelSpec, layers: tuple[int, ...], **kwargs: bool) -> LlamaModel:
        return MoeModel(spec, layers, experts=self.held, **kwargs)

    def moe_blocks(self) -> list[MoeBlock]:
        return [layer.block for layer in self.model.layers.values() if isinstance(layer, MoeDecoderLayer)]

    def set_aux_scale(self, scale: float) -> None:
        """The weight of one forward's load-balancing loss in the step's loss (1: the loss of this forward
        alone; a training loop of n equal micro-batches per step sets 1/n)."""
        for block in self.moe_blocks():
            block.aux_scale = scale

    def balance_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss summed over this module's MoE layers, unscaled and detached
        (for logs; its gradient flows through the forward's output when ``aux_loss_coef`` > 0)."""
        losses = [b.last_balance_loss for b in self.moe_blocks() if b.last_balance_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def routers(self) -> dict[str, Router]:
        """This module's routers by the name of their bias buffer (``params.router_biases``' keys)."""
        return {f"{name}.{ROUTER_BIAS}": m for name, m in self.named_modules() if isinstance(m, Router)}

    @torch.no_grad()
    def update_router_biases(self) -> dict[str, torch.Tensor]:
        """After a step, single device: every router's load over the step (by its bias buffer's name, as
        ``routers``), each router's bias moved by it where the model balances so (aux-loss-free balancing)."""
        loads = {}
        for name, router in self.routers().items():
            loads[name] = router.take_load()
            if router.moe.bias_update_rate > 0:
                router.update_bias(loads[name])
        return loads


def causal_lm(spec: ModelSpec, layers=None, *, embed: bool = True, head: bool = True,
              experts: tuple[int, ...] | None = None) -> LlamaForCausalLM:
    """The runtime's decoder for ``spec``: Llama, or its MoE variant when ``spec.moe`` is set (holding only
    ``experts`` of the routed experts when given: an expert-parallel stage)."""
    if spec.moe is None:
        return LlamaForCausalLM(spec, layers, embed=embed, head=head)
    return MoeForCausalLM(spec, layers, embed=embed, head=head, experts=experts)

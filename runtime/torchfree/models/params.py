"""The parameter table of the Llama model: names, shapes, owner and TP split dimension.

This table is the contract between the model code (runtime/models/llama.py, Hugging Face names),
the annotations (which DS each parameter gets in each TP group) and the planner (memory). The TP
rule is Megatron's: q/k/v and gate/up are column parallel (split the output dim 0), o and down are
row parallel (split the input dim 1), embedding and head are vocab parallel (dim 0), norms are
duplicated.

A tied embedding (``tie_word_embeddings``) is one parameter, ``model.embed_tokens.weight``, held by the
first stages (lookup) and the last stages (head); there is no ``lm_head.weight``, as in Hugging Face's
checkpoints of such models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from runtime.torchfree.models.moe_names import MOE_NAMES, ROUTER, ROUTER_BIAS, SHARED, SHARED_GATE
from runtime.torchfree.spec.model import ModelSpec

Owner = Literal["embedding", "layer", "head"]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    owner: Owner
    layer: int | None  # decoder layer index for owner == "layer"
    tp_dim: int | None  # tensor dim split across a TP group; None = duplicated in the group
    tied: bool = False  # the embedding matrix, also used (and held) by the head stages as the head
    # A routed expert's tensor: its expert index. On an expert-parallel stage (``Stage.experts``) only the
    # expert's holders keep it, whole; elsewhere it splits over the TP group like the dense MLP.
    expert: int | None = None
    # The router: on an expert-parallel stage each device routes its own share of the tokens, so its gradient
    # is a summand per device (summed over the stage like any partial gradient).
    router: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layer_parameters(model: ModelSpec, layer: int) -> list[ParamInfo]:
    h, f, q, kv = model.hidden_size, model.ffn_hidden_size, model.q_dim, model.kv_dim
    p = f"model.layers.{layer}."
    attn = []
    for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        attn.append(ParamInfo(p + f"self_attn.{proj}.weight", (out, h), "layer", layer, 0))
        if model.qkv_bias:  # column parallel: the bias splits with the output features
            attn.append(ParamInfo(p + f"self_attn.{proj}.bias", (out,), "layer", layer, 0))
    ffn = moe_parameters(model, layer) if model.is_moe_layer(layer) else _swiglu(p + "mlp.", h, f, layer)
    return [
        ParamInfo(p + "input_layernorm.weight", (h,), "layer", layer, None),
        *attn,
        ParamInfo(p + "self_attn.o_proj.weight", (h, q), "layer", layer, 1),
        *([ParamInfo(p + f"self_attn.{n}.weight", (model.head_size,), "layer", layer, None)
           for n in ("q_norm", "k_norm")] if model.qk_norm else []),
        ParamInfo(p + "post_attention_layernorm.weight", (h,), "layer", layer, None),
        *ffn,
    ]


def _swiglu(prefix: str, h: int, f: int, layer: int, names: tuple[str, str, str] = ("gate_proj", "up_proj",
                                                                                      "down_proj"),
            expert: int | None = None) -> list[ParamInfo]:
    gate, up, down = names
    return [ParamInfo(f"{prefix}{gate}.weight", (f, h), "layer", layer, 0, expert=expert),
            ParamInfo(f"{prefix}{up}.weight", (f, h), "layer", layer, 0, expert=expert),
            ParamInfo(f"{prefix}{down}.weight", (h, f), "layer", layer, 1, expert=expert)]


def moe_parameters(model: ModelSpec, layer: int) -> list[ParamInfo]:
    """A MoE block: the router (duplicated in a TP group), each expert split as the dense MLP is, the
    shared experts as one MLP of their summed width, and the shared experts' gate (duplicated)."""
    assert model.moe is not None
    moe, h = model.moe, model.hidden_size
    n = MOE_NAMES[model.family]
    p = f"model.layers.{layer}.{n.block}."
    out = [ParamInfo(f"{p}{ROUTER}.weight", (moe.num_experts, h), "layer", layer, None, router=True)]
    for e in range(moe.num_experts):
        out += _swiglu(f"{p}experts.{e}.", h, moe.expert_ffn_size, layer, (n.gate, n.up, n.down), expert=e)
    if moe.shared_experts:
        out += _swiglu(f"{p}{SHARED}.", h, moe.shared_width, layer)
    if moe.shared_gate:
        out.append(ParamInfo(f"{p}{SHARED_GATE}.weight", (1, h), "layer", layer, None))
    return out


def router_biases(model: ModelSpec) -> dict[str, ParamInfo]:
    """Aux-loss-free balancing's training state (``moe.bias_update_rate`` > 0; else none): ``router_bias_names``
    with each router's parameter (every holder of the router holds its bias, the same on each)."""
    if model.moe is None or model.moe.bias_update_rate == 0:
        return {}
    return router_bias_names(model)


def router_bias_names(model: ModelSpec) -> dict[str, ParamInfo]:
    """Each MoE layer's router bias ``model.layers.{i}.{block}.gate.expert_bias`` [num_experts] with its
    router's parameter, whether or not the model balances by them."""
    if model.moe is None:
        return {}
    n = MOE_NAMES[model.family]
    return {f"model.layers.{i}.{n.block}.{ROUTER}.{ROUTER_BIAS}": moe_parameters(model, i)[0]
            for i in range(model.num_layers) if model.is_moe_layer(i)}


def llama_parameters(model: ModelSpec) -> list[ParamInfo]:
    """Every parameter of the model, in module order."""
    h, v = model.hidden_size, model.vocab_size
    tied = model.tie_word_embeddings
    out = [ParamInfo("model.embed_tokens.weight", (v, h), "embedding", None, 0, tied=tied)]
    for i in range(model.num_layers):
        out.extend(layer_parameters(model, i))
    out.append(ParamInfo("model.norm.weight", (h,), "head", None, None))
    if not tied:
        out.append(ParamInfo("lm_head.weight", (v, h), "head", None, 0))
    return out

"""The parameter table of any decoder the planner prices: the runtime's Llama (runtime/torchfree/models/params.py)
or a GPT-style decoder (GPT-2, OPT, GPT-NeoX, GPT-Neo), with their Hugging Face module names.

GPT-style decoders are priced, not trained (``ModelSpec.train_problem``): their table feeds the gradient
sync layout, the per-stage memory and the tensor counts. The TP rule is Megatron's, as for Llama: q/k/v
(fused or not) and the MLP's first matrix are column parallel (output dim 0, their biases with them),
the attention output and the MLP's second matrix row parallel (input dim 1; their biases duplicated, as
the sum they are added to is), LayerNorms duplicated, the token embedding and head vocab parallel (dim
0), the learned position embedding duplicated. Shapes are (out, in) for every matrix (GPT-2's Conv1D
stores the transpose: the same count).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.torchfree.models.params import ParamInfo, llama_parameters
from runtime.torchfree.spec.model import ModelSpec


@dataclass(frozen=True)
class GptNames:
    """A family's module names: the prefixes and the per-layer modules (``qkv``: one fused projection,
    else ``q``/``k``/``v`` apart)."""

    embed: str
    positions: str | None
    layer: str            # with {i} for the layer index
    norm1: str
    norm2: str
    qkv: str | None
    q: str
    k: str
    v: str
    out: str
    fc1: str
    fc2: str
    final_norm: str
    head: str
    qkv_bias: bool = True


NAMES = {
    "gpt2": GptNames("transformer.wte", "transformer.wpe", "transformer.h.{i}.", "ln_1", "ln_2", "attn.c_attn",
                     "", "", "", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "transformer.ln_f", "lm_head"),
    "opt": GptNames("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.layers.{i}.",
                    "self_attn_layer_norm", "final_layer_norm", None, "self_attn.q_proj", "self_attn.k_proj",
                    "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2", "model.decoder.final_layer_norm",
                    "lm_head"),
    "gpt_neox": GptNames("gpt_neox.embed_in", None, "gpt_neox.layers.{i}.", "input_layernorm",
                         "post_attention_layernorm", "attention.query_key_value", "", "", "", "attention.dense",
                         "mlp.dense_h_to_4h", "mlp.dense_4h_to_h", "gpt_neox.final_layer_norm", "lm_head"),
    "gpt_neo": GptNames("transformer.wte", "transformer.wpe", "transformer.h.{i}.", "ln_1", "ln_2", None,
                        "attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj",
                        "attn.attention.out_proj", "mlp.c_fc", "mlp.c_proj", "transformer.ln_f", "lm_head",
                        qkv_bias=False),
}


def _linear(name: str, out: int, inp: int, owner: str, layer: int | None, tp_dim: int | None,
            bias: bool = True) -> list[ParamInfo]:
    """A biased linear layer: a column-parallel one's bias splits with it, a row-parallel one's is whole."""
    w = ParamInfo(f"{name}.weight", (out, inp), owner, layer, tp_dim)  # type: ignore[arg-type]
    if not bias:
        return [w]
    return [w, ParamInfo(f"{name}.bias", (out,), owner, layer, 0 if tp_dim == 0 else None)]  # type: ignore[arg-type]


def _norm(name: str, h: int, owner: str, layer: int | None) -> list[ParamInfo]:
    return [ParamInfo(f"{name}.weight", (h,), owner, layer, None),  # type: ignore[arg-type]
            ParamInfo(f"{name}.bias", (h,), owner, layer, None)]  # type: ignore[arg-type]


def gpt_layer_parameters(model: ModelSpec, layer: int) -> list[ParamInfo]:
    n = NAMES[model.architecture]
    h, f = model.hidden_size, model.ffn_hidden_size
    p = n.layer.format(i=layer)
    out = _norm(p + n.norm1, h, "layer", layer)
    if n.qkv is not None:
        out += _linear(p + n.qkv, 3 * h, h, "layer", layer, 0, n.qkv_bias)
    else:
        for proj in (n.q, n.k, n.v):
            out += _linear(p + proj, h, h, "layer", layer, 0, n.qkv_bias)
    out += _linear(p + n.out, h, h, "layer", layer, 1)
    out += _norm(p + n.norm2, h, "layer", layer)
    out += _linear(p + n.fc1, f, h, "layer", layer, 0)
    out += _linear(p + n.fc2, h, f, "layer", layer, 1)
    return out


def gpt_parameters(model: ModelSpec) -> list[ParamInfo]:
    """Every parameter of a GPT-style decoder, in module order (a tied head is the embedding matrix)."""
    n = NAMES[model.architecture]
    h, v, tied = model.hidden_size, model.vocab_size, model.tie_word_embeddings
    out = [ParamInfo(f"{n.embed}.weight", (v, h), "embedding", None, 0, tied=tied)]
    if n.positions is not None:
        out.append(ParamInfo(f"{n.positions}.weight", (model.position_rows, h), "embedding", None, None))
    for i in range(model.num_layers):
        out += gpt_layer_parameters(model, i)
    out += _norm(n.final_norm, h, "head", None)
    if not tied:
        out.append(ParamInfo(f"{n.head}.weight", (v, h), "head", None, 0))
    return out


def model_parameters(model: ModelSpec) -> list[ParamInfo]:
    """Every parameter of ``model``, in module order, whichever decoder it is."""
    return gpt_parameters(model) if model.gpt else llama_parameters(model)

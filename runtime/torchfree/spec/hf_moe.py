"""The mixture-of-experts keys of a Hugging Face ``config.json`` (Mixtral, Qwen2-MoE, Qwen3-MoE) <-> MoeSpec.

Mixtral: every layer routed over ``num_local_experts`` experts of width ``intermediate_size``, top-k
probabilities renormalised. Qwen2-MoE: experts of width ``moe_intermediate_size``, layer i routed when
``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers`` (the others dense, of width
``intermediate_size``), one shared expert of width ``shared_expert_intermediate_size`` behind a sigmoid
gate, renormalisation by ``norm_topk_prob``. Qwen3-MoE: Qwen2-MoE's keys without the shared expert (its
attention's per-head q/k norms are ``ModelSpec.qk_norm``). As in ``transformers``, ``router_aux_loss_coef`` weighs the
load-balancing loss only when ``output_router_logits`` is true (else there is none).

Aux-loss-free balancing, a capacity factor and a router skew have no Hugging Face keys: a model file sets
them. Its checkpoints' config.json then describes the same weights and routing (the bias of aux-loss-free
balancing aside, which is why such a model does not export: ``export_problem``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from runtime.torchfree.errors import FieldErrors, Problem, SpecError
from runtime.torchfree.spec.hf_fields import Fields
from runtime.torchfree.spec.moe import MoeSpec

if TYPE_CHECKING:
    from runtime.torchfree.spec.model import ModelSpec

# MoeSpec field -> config.json key, per model_type (for problems found by MoeSpec's own validation).
KEYS = {"mixtral": {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
                    "expert_ffn_size": "intermediate_size", "aux_loss_coef": "router_aux_loss_coef"},
        "qwen2_moe": {"num_experts": "num_experts", "top_k": "num_experts_per_tok",
                      "expert_ffn_size": "moe_intermediate_size", "shared_ffn_size": "shared_expert_intermediate_size",
                      "sparse_step": "decoder_sparse_step", "dense_layers": "mlp_only_layers",
                      "aux_loss_coef": "router_aux_loss_coef"}}
KEYS["qwen3_moe"] = KEYS["qwen2_moe"]
# What a model file may set that config.json cannot say (reset by ``hf_view``).
TRAINING_ONLY = ("bias_update_rate", "capacity_factor", "expert_load")


def qkv_bias(f: Fields, model_type: str) -> bool:
    """Whether q/k/v carry a bias: always for Qwen2, by ``qkv_bias`` (default true) for Qwen2-MoE."""
    if model_type == "qwen2_moe":
        return f.get_bool("qkv_bias", True)
    return model_type == "qwen2"


def _aux_coef(f: Fields) -> float:
    coef = f.get_float("router_aux_loss_coef", 0.001)
    return coef if f.get_bool("output_router_logits", False) else 0.0


def moe_from_config(f: Fields, model_type: str, intermediate: int | None, layers: int | None) -> MoeSpec | None:
    """The MoeSpec of a Mixtral or Qwen2-MoE config (None for a dense model_type); problems go to ``f``."""
    if model_type == "mixtral":
        jitter = f.get_float("router_jitter_noise", 0.0)
        if jitter:
            f.bad("router_jitter_noise", f"{jitter:g} is not supported (the runtime's router adds no noise)")
        values: dict[str, Any] = {"num_experts": f.get_int("num_local_experts", 8),
                                  "top_k": f.get_int("num_experts_per_tok", 2), "expert_ffn_size": intermediate,
                                  "aux_loss_coef": _aux_coef(f)}
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        shared = f.get_int("shared_expert_intermediate_size", required=True) if model_type == "qwen2_moe" else 0
        if model_type == "qwen2_moe" and shared is not None and shared < 1:
            f.bad("shared_expert_intermediate_size", f"must be at least 1 (Qwen2-MoE's shared expert), got {shared}")
            shared = None  # reported: MoeSpec then takes the experts' width
        dense = f.data.get("mlp_only_layers", [])
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            f.bad("mlp_only_layers", f"expected a list of layer indices, got {str(dense)[:40]}")
            dense = []
        for i, layer in enumerate(dense):
            if layers is not None and not 0 <= layer < layers:
                f.bad(f"mlp_only_layers[{i}]", f"{layer} is not a layer index (num_hidden_layers is {layers})")
        dense = [i for i in dense if layers is None or 0 <= i < layers]  # the rest is checked below
        # transformers 5 writes Qwen3-MoE's count as num_local_experts (published configs: num_experts)
        count = "num_local_experts" if "num_experts" not in f.data and "num_local_experts" in f.data else "num_experts"
        values = {"num_experts": f.get_int(count, required=True),
                  "top_k": f.get_int("num_experts_per_tok", required=True),
                  "expert_ffn_size": f.get_int("moe_intermediate_size", required=True),
                  "shared_experts": int(model_type == "qwen2_moe"), "shared_ffn_size": shared or None,
                  "shared_gate": model_type == "qwen2_moe",
                  "sparse_step": f.get_int("decoder_sparse_step", 1), "dense_layers": tuple(dense),
                  "norm_topk_prob": f.get_bool("norm_topk_prob", False), "aux_loss_coef": _aux_coef(f)}
    else:
        return None
    if any(values[k] is None for k in ("num_experts", "top_k", "expert_ffn_size")):
        return None  # already reported, once
    try:
        return MoeSpec(**values)
    except FieldErrors as err:
        for field, message in err.problems:
            key = KEYS[model_type].get(field.split("[")[0], field)
            f.bad(key + field[len(field.split("[")[0]):], message)
        return None


def hf_field(model_type: str, field: str) -> str | None:
    """The config.json key of a ModelSpec problem's ``moe.*`` field (None: not a MoE field)."""
    if field == "moe":  # no routed layer: the layer rule's keys
        return "decoder_sparse_step" if model_type in ("qwen2_moe", "qwen3_moe") else None
    if not field.startswith("moe."):
        return None
    name = field[len("moe."):]
    base = name.split("[")[0]
    return KEYS.get(model_type, {}).get(base, base) + name[len(base):]


def hf_view(spec: ModelSpec) -> ModelSpec:
    """``spec`` as its config.json reads back: the MoE options config.json has no keys for at their defaults."""
    if spec.moe is None:
        return spec
    defaults = {f.name: f.default for f in dataclasses.fields(MoeSpec) if f.name in TRAINING_ONLY}
    return dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, **defaults))


def export_problem(spec: ModelSpec) -> tuple[str, str] | None:
    """(field, why) when ``spec``'s MoE block has no Hugging Face layout, else None."""
    moe = spec.moe
    if moe is None:
        return None
    if moe.bias_update_rate > 0:
        return ("moe.bias_update_rate", "the router bias of aux-loss-free balancing has no place in "
                                        f"{spec.family}'s Hugging Face layout (the export would route differently)")
    if spec.family == "qwen2_moe" and (moe.shared_experts != 1 or not moe.shared_gate):
        return ("moe.shared_experts", "qwen2_moe's Hugging Face layout has exactly one shared expert behind a "
                                      f"gate (shared_experts 1, shared_gate true); got {moe.shared_experts}, "
                                      f"shared_gate {str(moe.shared_gate).lower()}")
    return None


def moe_config(spec: ModelSpec) -> dict[str, Any]:
    """The MoE keys of ``spec``'s config.json (the shape keys are written by ``config_for``)."""
    moe = spec.moe
    assert moe is not None
    found = export_problem(spec)
    if found is not None:
        raise SpecError([Problem(spec.name, *found)])
    out: dict[str, Any] = {"num_experts_per_tok": moe.top_k, "output_router_logits": moe.aux_loss_coef > 0}
    if moe.aux_loss_coef > 0:
        out["router_aux_loss_coef"] = moe.aux_loss_coef
    if spec.family == "mixtral":
        out.update({"num_local_experts": moe.num_experts, "intermediate_size": moe.expert_ffn_size,
                    "router_jitter_noise": 0.0})
    else:
        out.update({"num_experts": moe.num_experts, "moe_intermediate_size": moe.expert_ffn_size,
                    "decoder_sparse_step": moe.sparse_step, "mlp_only_layers": list(moe.dense_layers),
                    "norm_topk_prob": moe.norm_topk_prob})
    if spec.family == "qwen2_moe":
        out.update({"shared_expert_intermediate_size": moe.shared_width, "qkv_bias": spec.qkv_bias})
    if spec.family == "qwen3_moe":
        out["attention_bias"] = False
    return out

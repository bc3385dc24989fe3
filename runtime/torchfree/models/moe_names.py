"""Parameter names of a MoE block, per family: Hugging Face's, so that checkpoints of a MoE model are plain
``transformers`` checkpoints (``from_pretrained`` opens them, and hspmd loads theirs) with no renaming.

Mixtral: ``model.layers.{i}.block_sparse_moe.gate.weight`` (router) and ``...experts.{j}.w1/w3/w2.weight``
(gate, up, down). Qwen2-MoE: ``model.layers.{i}.mlp.gate.weight`` and ``...experts.{j}.gate_proj/up_proj/
down_proj.weight``, the shared expert ``mlp.shared_expert.*`` and its gate ``mlp.shared_expert_gate.weight``.
Kept free of torch: the planner's parameter table (runtime/torchfree/models/params.py) reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeNames:
    block: str  # the decoder layer's attribute holding the MoE block (in place of ``mlp``)
    gate: str   # an expert's projections: SwiGLU's gate, up and down
    up: str
    down: str


ROUTER = "gate"
ROUTER_BIAS = "expert_bias"  # the router's buffer of aux-loss-free balancing (training state, not a parameter)
SHARED = "shared_expert"
SHARED_GATE = "shared_expert_gate"
SWIGLU_NAMES = MoeNames("mlp", "gate_proj", "up_proj", "down_proj")  # Llama's MLP; shared experts use it too
MOE_NAMES = {"mixtral": MoeNames("block_sparse_moe", "w1", "w3", "w2"), "qwen2_moe": SWIGLU_NAMES,
             "qwen3_moe": SWIGLU_NAMES}

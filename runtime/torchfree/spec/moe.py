"""The mixture-of-experts part of a model spec: which layers route tokens to experts, and how.

A MoE layer replaces the dense SwiGLU MLP by ``num_experts`` SwiGLU experts of width ``expert_ffn_size``,
a router choosing ``top_k`` of them per token, and optionally shared experts that every token passes
through (Qwen2-MoE: one, its output scaled by a sigmoid gate; DeepSeek-MoE: several, ungated). Layers
follow Qwen-MoE's rule: layer i is a MoE layer when ``(i + 1) % sparse_step == 0`` and i is not listed in
``dense_layers`` (Mixtral: every layer; DeepSeek's first dense layers: ``dense_layers: [0, 1, 2]``).
Figures that need the layer count (``dense_layers`` in range, at least one MoE layer) are checked by
``ModelSpec``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.torchfree.errors import Checker

# Published MoE models route over 8 (Mixtral) to 256 (DeepSeek-V3) experts; the bound keeps a hostile file
# from making the router and the parameter table allocate millions of experts.
MAX_EXPERTS = 4096
# A load-balancing loss coefficient is 1e-4 to 1e-1 in published configs; beyond 100 the auxiliary loss
# outweighs the language-model loss by orders of magnitude (a unit slip).
MAX_AUX_LOSS_COEF = 100.0
# DeepSeek-V3's bias update speed is 1e-3; a step of 1 or more moves the bias past the whole range of the
# softmax scores it is added to, so every step flips which experts are chosen.
MAX_BIAS_UPDATE_RATE = 1.0


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int                     # experts each token is routed to
    expert_ffn_size: int           # SwiGLU width of one routed expert
    shared_experts: int = 0        # experts every token passes through (fused into one MLP)
    shared_ffn_size: int | None = None  # width of one shared expert; expert_ffn_size when not given
    shared_gate: bool = False      # Qwen2-MoE: the shared output is scaled by sigmoid(x . w), w of shape [1, hidden]
    sparse_step: int = 1           # layer i is MoE when (i + 1) % sparse_step == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... unless listed here
    # Renormalise the chosen top-k probabilities to sum to 1 (Mixtral always does; Qwen-MoE's
    # ``norm_topk_prob``).
    norm_topk_prob: bool = True
    # Switch-Transformer load-balancing loss, num_experts * sum_e f_e * P_e per MoE layer (1 when balanced),
    # summed over MoE layers and scaled by this coefficient; 0: none.
    aux_loss_coef: float = 0.0
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for choosing the
    # top-k (not for weighting them), moved by this much after each step towards the mean load; 0: off.
    bias_update_rate: float = 0.0
    # Tokens one expert takes in one micro-batch: ceil(capacity_factor * tokens * top_k / num_experts), the
    # rest dropped (their residual passes on); None: dropless, every routed token is computed.
    capacity_factor: float | None = None
    # Router skew for pricing: the relative share of tokens each expert receives (normalised); None: even.
    expert_load: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(1 <= self.num_experts <= MAX_EXPERTS, "num_experts",
                    f"must be in [1, {MAX_EXPERTS}], got {self.num_experts}")
            if c.check(self.top_k >= 1, "top_k", f"must be at least 1, got {self.top_k}"):
                c.check(self.top_k <= self.num_experts, "top_k",
                        f"{self.top_k} is more than num_experts {self.num_experts} (a token is routed to top_k "
                        "distinct experts)")
            c.check(self.expert_ffn_size >= 1, "expert_ffn_size", f"must be at least 1, got {self.expert_ffn_size}")
            c.check(0 <= self.shared_experts <= MAX_EXPERTS, "shared_experts",
                    f"must be in [0, {MAX_EXPERTS}], got {self.shared_experts}")
            if self.shared_ffn_size is not None:
                c.check(self.shared_ffn_size >= 1, "shared_ffn_size", f"must be at least 1, got {self.shared_ffn_size}")
                c.check(self.shared_experts >= 1, "shared_ffn_size", "given without shared_experts")
            c.check(not self.shared_gate or self.shared_experts >= 1, "shared_gate",
                    "true without shared_experts (it gates their output)")
            c.check(self.sparse_step >= 1, "sparse_step", f"must be at least 1, got {self.sparse_step}")
            for i, layer in enumerate(self.dense_layers):
                c.check(layer >= 0, f"dense_layers[{i}]", f"must be a layer index (at least 0), got {layer}")
            c.check(len(set(self.dense_layers)) == len(self.dense_layers), "dense_layers", "lists a layer twice")
            c.check(0 <= self.aux_loss_coef <= MAX_AUX_LOSS_COEF, "aux_loss_coef",
                    f"must be in [0, {MAX_AUX_LOSS_COEF:g}], got {self.aux_loss_coef:g}")
            c.check(0 <= self.bias_update_rate < MAX_BIAS_UPDATE_RATE, "bias_update_rate",
                    f"must be in [0, {MAX_BIAS_UPDATE_RATE:g}), got {self.bias_update_rate:g}")
            if self.capacity_factor is not None:
                c.check(0 < self.capacity_factor <= self.num_experts, "capacity_factor",
                        f"must be in (0, num_experts {self.num_experts}] (at num_experts an expert can take every "
                        f"token: dropless), got {self.capacity_factor:g}")
            if self.expert_load is not None:
                if c.check(len(self.expert_load) == self.num_experts, "expert_load",
                           f"has {len(self.expert_load)} shares, num_experts is {self.num_experts}"):
                    for i, share in enumerate(self.expert_load):
                        c.check(share >= 0, f"expert_load[{i}]", f"must be at least 0, got {share:g}")
                    c.check(sum(self.expert_load) > 0, "expert_load", "all shares are 0 (no expert receives tokens)")

    def is_moe_layer(self, layer: int) -> bool:
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers

    @property
    def shared_width(self) -> int:
        """Width of the fused shared-expert MLP (0: none)."""
        return self.shared_experts * (self.expert_ffn_size if self.shared_ffn_size is None else self.shared_ffn_size)

    def capacity(self, tokens: int) -> int | None:
        """Tokens one expert computes of a micro-batch of ``tokens`` (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def params(self, hidden: int) -> int:
        """Parameters of one MoE block: router, routed experts, shared experts and their gate."""
        return (self.num_experts * hidden + self.num_experts * 3 * hidden * self.expert_ffn_size
                + 3 * hidden * self.shared_width + (hidden if self.shared_gate else 0))

    def active_params(self, hidden: int) -> int:
        """Parameters one token passes through in a MoE block (router, top_k experts, shared experts)."""
        return (self.num_experts * hidden + self.top_k * 3 * hidden * self.expert_ffn_size
                + 3 * hidden * self.shared_width + (hidden if self.shared_gate else 0))

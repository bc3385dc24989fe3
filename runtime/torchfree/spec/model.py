"""Model spec: the shape of a decoder, as the catalog in configs/models/ or a Hugging Face ``config.json``
(runtime/torchfree/spec/hf.py) gives it. The runtime trains the Llama family; GPT-style decoders (``architecture``:
gpt2, opt, gpt_neox, gpt_neo) are priced by the planner, the cost model and the simulator from their
shapes (LayerNorm with biases, a 2-matrix GELU MLP, biased projections, learned position embeddings
where the family has them, multi-head attention), and refused by ``hspmd train``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runtime.torchfree.errors import Checker
from runtime.torchfree.spec.moe import MoeSpec

MAX_LAYERS = 1024  # the planner works per layer; a bound on what a (hostile) file makes it search
# A norm's epsilon is added to a mean square of order 1: shipped models use 1e-12 (BERT) to 1e-5. Beyond 0.1 it
# outweighs the activations it normalises (``rms_norm_eps: 1e300`` zeroed every layer's output); below 1e-30 it
# is zero in fp32 and bf16 arithmetic (a zero row then divides by zero).
NORM_EPS_RANGE = (1e-30, 0.1)
# RoPE's base: frequencies theta^(-2i/d) need theta > 1 (at 1 every position rotates alike; below, the
# frequencies grow with i). Published bases are 1e4 to 3.6e9 (a 1M-context Llama 3); at 1e300 every frequency
# but the first is below fp32's resolution of a position: no position information at all.
MAX_ROPE_THETA = 1e12
# Llama 3.x's RoPE scaling: factor 8 and frequency factors 1 and 4 are published; beyond 1e4 the wavelengths
# (or the band between the two factors) leave no frequency the model was trained with.
MAX_ROPE_FACTOR = 1e4
# Experts over all MoE layers (DeepSeek-V3: 58 x 256 = 14,848); each is three tensors of the parameter table.
MAX_EXPERT_BLOCKS = 65536
# How the planner, the cost model and the simulator price a MoE layer (planner/costmodel/moe.py): said with every
# plan and simulation of a MoE model, as any assumption is.
MOE_PRICING = ("MoE layers priced from the dense layer of the same shapes: router, routed and shared experts as "
               "GEMMs at the time per FLOP and per call the profile gives the dense MLP, per device type (fewer "
               "rows per expert assumed as efficient); expert loads {load}")

# The Hugging Face ``model_type``s whose decoder the runtime's Llama is: Llama 2/3, Mistral, Qwen2 differ
# only in figures this spec holds (head_dim, q/k/v bias, tied embeddings, rope scaling). Mixtral,
# Qwen2-MoE and Qwen3-MoE (with per-head q/k norms) are the same decoder with MoE layers (``moe``); the
# family fixes their parameter names.
Family = Literal["llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe"]
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The decoder's layout: the runtime's Llama (``family`` then says which variant), or a GPT-style decoder
# named by its Hugging Face ``model_type``.
Architecture = Literal["llama", "gpt2", "opt", "gpt_neox", "gpt_neo"]
GPT_ARCHITECTURES = ("gpt2", "opt", "gpt_neox", "gpt_neo")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's frequency-dependent RoPE rescaling (``rope_type: llama3``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, shorter than
    ``... / high_freq_factor`` kept, those between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: Literal["llama3"] = "llama3"

    def __post_init__(self) -> None:
        with Checker() as c:
            c.check(1 <= self.factor <= MAX_ROPE_FACTOR, "factor",
                    f"must be in [1, {MAX_ROPE_FACTOR:g}], got {self.factor:g}")
            c.check(0 < self.low_freq_factor <= MAX_ROPE_FACTOR, "low_freq_factor",
                    f"must be in (0, {MAX_ROPE_FACTOR:g}], got {self.low_freq_factor:g}")
            c.check(self.high_freq_factor <= MAX_ROPE_FACTOR, "high_freq_factor",
                    f"must be at most {MAX_ROPE_FACTOR:g}, got {self.high_freq_factor:g}")
            c.check(self.high_freq_factor > self.low_freq_factor, "high_freq_factor",
                    f"must exceed low_freq_factor {self.low_freq_factor}, got {self.high_freq_factor}")
            c.check(self.original_max_position_embeddings >= 1, "original_max_position_embeddings",
                    "must be at least 1")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder's sizes; the runtime builds the module, the planner costs it."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    family: Family = "llama"
    # Per-head width; hidden_size / num_heads when not given (Mistral-Nemo-style configs set it apart).
    head_dim: int | None = None
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k (weights of head_dim), before RoPE
    tie_word_embeddings: bool = False  # the head multiplies by the embedding matrix (one weight)
    rope_scaling: RopeScaling | None = None
    # Attention window, when the model uses one (Mistral v0.1): the runtime cannot train it (``train_problem``).
    sliding_window: int | None = None
    architecture: Architecture = "llama"
    moe: MoeSpec | None = None  # mixture-of-experts layers (runtime/torchfree/spec/moe.py); None: dense

    def __post_init__(self) -> None:
        with Checker() as c:
            # An empty name was accepted: reports read 'on cpu-hetero4', checkpoints recorded model ''.
            c.check(bool(self.name.strip()), "name", "must not be empty")
            c.each(self, ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads", "vocab_size",
                          "max_seq_len"), lambda v: v >= 1, "must be at least 1")
            c.check(self.num_layers <= MAX_LAYERS, "num_layers", f"must be at most {MAX_LAYERS}, got {self.num_layers}")
            c.check(1 < self.rope_theta <= MAX_ROPE_THETA, "rope_theta",
                    f"must be in (1, {MAX_ROPE_THETA:g}] (RoPE's base), got {self.rope_theta:g}")
            lo, hi = NORM_EPS_RANGE
            c.check(lo <= self.norm_eps <= hi, "norm_eps",
                    f"must be in [{lo:g}, {hi:g}] (added to a mean square of order 1), got {self.norm_eps:g}")
            if self.sliding_window is not None:
                c.check(self.sliding_window >= 1, "sliding_window", f"must be at least 1, got {self.sliding_window}")
            if self.head_dim is None:
                if self.num_heads >= 1 and self.hidden_size >= 1 and c.check(
                        self.hidden_size % self.num_heads == 0, "hidden_size",
                        f"{self.hidden_size} is not divisible by num_heads {self.num_heads} (or give head_dim)"):
                    object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
            else:
                c.check(self.head_dim >= 1, "head_dim", f"must be at least 1, got {self.head_dim}")
            if self.num_kv_heads >= 1 and self.num_heads >= 1:
                c.check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                        f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
            if self.gpt:
                c.check(self.num_kv_heads == self.num_heads, "num_kv_heads",
                        f"a {self.architecture} decoder has multi-head attention: must equal num_heads "
                        f"{self.num_heads}")
            if not c.problems and self.rotary:
                c.check(self.head_size % 2 == 0, "head_dim",
                        f"head dimension {self.head_size} must be even for rotary embeddings")
            self._check_moe(c)

    def _check_moe(self, c: Checker) -> None:
        """The MoE block against the layer count and the family, whose names and Hugging Face layout it takes."""
        moe = self.moe
        c.check(self.qk_norm == (self.family == "qwen3_moe"), "qk_norm",
                f"{str(self.qk_norm).lower()} for family {self.family} (q/k norms are Qwen3-MoE's, and it has them)")
        if moe is None:
            c.check(self.family not in MOE_FAMILIES, "moe",
                    f"missing: family {self.family} is a mixture-of-experts decoder")
            return
        if not c.check(not self.gpt, "moe", f"a {self.architecture} decoder has no MoE layers") or not c.check(
                self.family in MOE_FAMILIES, "family",
                       f"{self.family} has no MoE layers; a model with moe is family "
                       f"{', '.join(MOE_FAMILIES)}"):
            return
        for i, layer in enumerate(moe.dense_layers):
            c.check(layer < self.num_layers, f"moe.dense_layers[{i}]",
                    f"layer {layer} is beyond num_layers {self.num_layers}")
        routed = sum(moe.is_moe_layer(i) for i in range(self.num_layers))
        c.check(routed >= 1, "moe", f"no layer of {self.num_layers} is a MoE layer (sparse_step {moe.sparse_step}, "
                                    f"dense_layers {list(moe.dense_layers)})")
        c.check(routed * moe.num_experts <= MAX_EXPERT_BLOCKS, "moe.num_experts",
                f"{routed} MoE layers of {moe.num_experts} experts are {routed * moe.num_experts:,} experts in all "
                f"(at most {MAX_EXPERT_BLOCKS:,}: every expert is three tensors of the parameter table)")
        if self.family == "qwen3_moe":
            c.check(moe.shared_experts == 0, "moe.shared_experts", "must be 0 for family qwen3_moe")
        if self.family == "mixtral":  # Mixtral's layout: every layer routed, no shared expert
            c.check(moe.shared_experts == 0, "moe.shared_experts", "must be 0 for family mixtral")
            c.check(moe.sparse_step == 1 and not moe.dense_layers, "moe.dense_layers",
                    "family mixtral has no dense layers (sparse_step 1, dense_layers [])")
            c.check(moe.norm_topk_prob, "moe.norm_topk_prob", "must be true for family mixtral")
            c.check(self.ffn_hidden_size == moe.expert_ffn_size, "ffn_hidden_size",
                    f"{self.ffn_hidden_size} differs from moe.expert_ffn_size {moe.expert_ffn_size} (Mixtral's "
                    "intermediate_size is its experts' width)")

    @property
    def gpt(self) -> bool:
        """A GPT-style decoder (priced, not trained)."""
        return self.architecture in GPT_ARCHITECTURES

    @property
    def rotary(self) -> bool:
        """Positions by rotary embeddings (Llama, GPT-NeoX) rather than a learned table."""
        return self.architecture in ("llama", "gpt_neox")

    @property
    def position_rows(self) -> int:
        """Rows of the learned position-embedding table (0: rotary). OPT's table has 2 rows of offset."""
        if self.rotary:
            return 0
        return self.max_seq_len + (2 if self.architecture == "opt" else 0)

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: RMSNorm's weight, or LayerNorm's weight and bias."""
        return 2 * self.hidden_size if self.gpt else self.hidden_size

    def attention_params(self) -> int:
        """One layer's attention: q, k, v and output projections, with the biases the family has (GPT-2,
        OPT, GPT-NeoX: every projection; GPT-Neo: the output one; Qwen2: q/k/v)."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        weights = h * q + 2 * h * kv + q * h
        if self.gpt:
            return weights + h + (0 if self.architecture == "gpt_neo" else q + 2 * kv)
        return weights + ((q + 2 * kv) if self.qkv_bias else 0) + (2 * self.head_size if self.qk_norm else 0)

    def mlp_params(self) -> int:
        """One dense layer's MLP: SwiGLU's gate, up and down (Llama), or two biased matrices (GPT-style)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return 2 * h * f + f + h if self.gpt else 3 * h * f

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` routes tokens to experts (a MoE block in place of the dense MLP)."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def head_size(self) -> int:
        """``head_dim`` as an int (always set after construction)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def q_dim(self) -> int:
        """Output width of the query projection (= hidden_size unless head_dim is set apart)."""
        return self.num_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_size

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of decoder block ``layer`` (default: a dense one): attention, MLP or MoE block, two norms."""
        ffn = self.moe.params(self.hidden_size) if layer is not None and self.moe is not None \
            and self.moe.is_moe_layer(layer) else self.mlp_params()
        return self.attention_params() + ffn + 2 * self.norm_params

    def active_layer_params(self, layer: int) -> int:
        """Parameters one token passes through in decoder block ``layer``: a MoE block's router, its top-k
        experts and shared experts, not all its experts (what model FLOPs count)."""
        if self.moe is None or not self.moe.is_moe_layer(layer):
            return self.layer_params()
        return self.attention_params() + self.moe.active_params(self.hidden_size) + 2 * self.norm_params

    def embedding_params(self) -> int:
        """The token embedding and, where the family learns one, the position embedding."""
        return (self.vocab_size + self.position_rows) * self.hidden_size

    def head_params(self) -> int:
        """Final norm and the output projection, as the last stage holds them (its own copy of the
        embedding matrix when tied)."""
        return self.norm_params + self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """Distinct parameters (a tied embedding counted once)."""
        tied = self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0
        layers = sum(self.layer_params(i) for i in range(self.num_layers)) if self.moe is not None \
            else self.num_layers * self.layer_params()
        return self.embedding_params() + layers + self.head_params() - tied

    def valid_tp_degrees(self, limit: int = 64) -> list[int]:
        """TP degrees that split heads, kv heads and the MLP evenly."""
        return [t for t in range(1, limit + 1) if self.tp_problem(t) is None]

    def tp_problem(self, tp: int) -> str | None:
        """Why this TP degree cannot shard the model, or None if it can."""
        # vocab_size: the embedding and the head are split by rows over their stage's TP group; an odd vocabulary
        # passed validation and failed annotating it ('dim 0 of extent 255 is not divisible by its split degree
        # 2') in show --device, simulate and plan, naming no file.
        widths = [("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                  ("ffn_hidden_size", self.ffn_hidden_size), ("vocab_size", self.vocab_size)]
        if self.moe is not None:  # experts are split like the dense MLP (Megatron's expert TP)
            widths += [("moe.expert_ffn_size", self.moe.expert_ffn_size), ("moe shared width", self.moe.shared_width)]
        bad = [f"{name} {value}" for name, value in widths if value % tp]
        if not bad:
            return None
        return f"TP degree {tp} does not divide " + ", ".join(bad)

    def train_problem(self, seq_len: int) -> tuple[str, str] | None:
        """(field, why) when the runtime cannot train this model at ``seq_len``, else None. The planner
        still prices such a model (a window as full causal attention)."""
        if self.gpt:
            return ("architecture", f"{self.architecture} is priced by the planner and simulator, not trained: "
                                    "the runtime trains the Llama family (llama, mistral, qwen2)")
        if self.sliding_window is not None and seq_len > self.sliding_window:
            return ("sliding_window", f"attention window {self.sliding_window} is shorter than seq_len {seq_len}; "
                                      "the runtime trains full causal attention only")
        return None

    def pricing_note(self, seq_len: int) -> str | None:
        """What the planner and simulator approximate for this model at ``seq_len`` (None: nothing)."""
        found = self.train_problem(seq_len)
        if self.moe is not None:
            load = "from moe.expert_load" if self.moe.expert_load is not None else "even (no moe.expert_load given)"
            moe = f"{self.name}: moe: {MOE_PRICING.format(load=load)}"
            return moe if found is None else f"{moe}; {found[0]}: {found[1]}"
        if found is None:
            return None
        if self.gpt:
            return (f"{self.name}: architecture {self.architecture}: priced from its shapes (LayerNorm, GELU MLP, "
                    "biases, position embeddings; hspmd train refuses it)")
        return f"{self.name}: {found[0]}: priced as full causal attention ({found[1]}; hspmd train refuses it)"

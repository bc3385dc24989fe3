"""Model spec: the shape of a Llama-family decoder, as the catalog in configs/models/ gives it."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import Checker

MAX_LAYERS = 1024  # the planner works per layer; a bound on what a (hostile) file makes it search


@dataclass(frozen=True)
class ModelSpec:
    """A Llama decoder's sizes; the runtime builds the module, the planner costs it."""

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

    def __post_init__(self) -> None:
        c = Checker()
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_heads", "num_kv_heads",
                      "vocab_size", "max_seq_len"):
            c.check(getattr(self, field) >= 1, field, f"must be at least 1, got {getattr(self, field)}")
        c.check(self.num_layers <= MAX_LAYERS, "num_layers", f"must be at most {MAX_LAYERS}, got {self.num_layers}")
        c.check(self.rope_theta > 0, "rope_theta", "must be positive")
        c.check(self.norm_eps > 0, "norm_eps", "must be positive")
        if self.num_heads >= 1 and self.hidden_size >= 1:
            c.check(self.hidden_size % self.num_heads == 0, "hidden_size",
                    f"{self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_kv_heads >= 1 and self.num_heads >= 1:
            c.check(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                    f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not c.problems:
            c.check(self.head_dim % 2 == 0, "hidden_size",
                    f"head dimension {self.head_dim} must be even for rotary embeddings")
        c.raise_if_any()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one decoder block: q,k,v,o projections, gate/up/down, two norms."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = h * h + 2 * h * self.kv_dim + h * h
        mlp = 3 * h * f
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm and the (untied) output projection."""
        return self.hidden_size + self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def valid_tp_degrees(self, limit: int = 64) -> list[int]:
        """TP degrees that split heads, kv heads and the MLP evenly."""
        return [t for t in range(1, limit + 1)
                if self.num_heads % t == 0 and self.num_kv_heads % t == 0
                and self.ffn_hidden_size % t == 0]

    def tp_problem(self, tp: int) -> str | None:
        """Why this TP degree cannot shard the model, or None if it can."""
        bad = [f"{name} {value}" for name, value in
               (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                ("ffn_hidden_size", self.ffn_hidden_size)) if value % tp]
        if not bad:
            return None
        return f"TP degree {tp} does not divide " + ", ".join(bad)

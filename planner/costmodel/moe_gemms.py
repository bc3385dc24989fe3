"""The compute seconds of a MoE layer's parts on one device type, at one TP degree and micro-batch shape: the
one rule the cost model (planner/costmodel/moe.py) and the sleep-mode emulation's block targets
(planner/costmodel/targets.py, hetu_cli/emulation.py) price MoE layers by.

A profile times dense layers, so every MoE GEMM block (the router, one expert, the shared experts) is priced
at the time per FLOP the profile gives the dense SwiGLU MLP at this shape, plus the MLP's fixed time per call
(its kernels' launch overhead) once per block that computes (docs/planning.md, "Mixture of experts").

The routing (experts, top-k, expected load, capacity) is always the trained model's: a placement names its
experts. The shapes (hidden size, dense, expert and shared widths) and the profile are the device type's own,
or, for a sleep-mode emulated type, its target's, whose micro-batch is ``token_scale`` times as many tokens
and whose seconds last ``time_scale`` wall seconds each (runtime/torchfree/spec/cluster.py ``Emulation``).
Rows (token, expert pairs) are counted in the trained model's tokens and scaled here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from runtime.torchfree.profiling.profile import ComponentFit, eval_fit
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.moe import MoeSpec
from runtime.torchfree.spec.plan import expert_destination


def expert_shares(moe: MoeSpec) -> tuple[float, ...]:
    """Each expert's share of the routed (token, expert) pairs: ``expert_load`` normalised, else even."""
    load = moe.expert_load or (1.0,) * moe.num_experts
    total = float(sum(load))
    return tuple(x / total for x in load)


def expert_rows(moe: MoeSpec, tokens: int) -> tuple[float, ...]:
    """Expected rows each expert computes in a micro-batch of ``tokens`` tokens: ``tokens * top_k * share``,
    at most the capacity under a capacity factor."""
    cap = moe.capacity(tokens)
    rows = tuple(tokens * moe.top_k * s for s in expert_shares(moe))
    return rows if cap is None else tuple(min(r, float(cap)) for r in rows)


def holder_rows(devices: Sequence[int], experts: Mapping[int, Sequence[int]] | Sequence, rows: Sequence[float]
                ) -> dict[int, dict[int, float]]:
    """Per device, per expert it holds: the rows it receives. Each of the n source ranks (the stage's devices in
    order) sends its 1/n of an expert's rows to holder ``h[s mod m]`` of the expert's m holders."""
    held = dict(experts)
    n = len(devices)
    out: dict[int, dict[int, float]] = {d: {} for d in devices}
    for e, r in enumerate(rows):
        holders = [d for d in devices if e in held.get(d, ())]
        sources = Counter(expert_destination(holders, s) for s in range(n))
        for h, c in sources.items():
            out[h][e] = out[h].get(e, 0.0) + r * c / n
    return out


@dataclass(frozen=True)
class GemmRate:
    """What a MoE GEMM block costs on one device type: seconds per forward FLOP and per call (one expert, the
    router, the shared experts: each its own kernels), forward and backward."""

    forward_per_flop: float
    backward_per_flop: float
    forward_per_call: float
    backward_per_call: float

    def seconds(self, flops: float, calls: int) -> tuple[float, float]:
        """(forward, backward) of ``calls`` blocks of ``flops`` forward FLOPs in all."""
        return (self.forward_per_flop * flops + self.forward_per_call * calls,
                self.backward_per_flop * flops + self.backward_per_call * calls)


@dataclass(frozen=True)
class MoeGemms:
    """A MoE layer's GEMM blocks priced on one device type at TP degree ``tp`` and micro-batch ``micro_batch`` x
    ``seq_len`` of the trained model (the module's rule). ``mlp``: the profile's dense MLP at this TP degree and
    the priced shape (``micro_batch`` x ``seq_len * token_scale``) of ``shapes``."""

    routing: MoeSpec
    shapes: ModelSpec
    mlp: ComponentFit
    tp: int
    micro_batch: int
    seq_len: int
    token_scale: int = 1
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.shapes.moe is None:
            raise ValueError(f"{self.shapes.name} is not a mixture-of-experts model: it has no expert shapes")

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch, priced (the target's, on a sleep-mode type)."""
        return self.micro_batch * self.seq_len * self.token_scale

    @cached_property
    def rate(self) -> GemmRate:
        """The dense MLP's seconds per forward FLOP and per call (its fit's constant term, where the fit has a
        per-token part; a measured table's constant fit is all per FLOP), wall seconds."""
        b, s = self.micro_batch, self.seq_len * self.token_scale
        flops = 6.0 * b * s * self.shapes.hidden_size * self.shapes.ffn_hidden_size / self.tp

        def split(fit: tuple[float, float, float]) -> tuple[float, float]:
            call = fit[2] if (fit[0] or fit[1]) else 0.0
            return (eval_fit(fit, b, s) - call) * self.time_scale / flops, call * self.time_scale
        (rf, cf), (rb, cb) = split(self.mlp.forward_s), split(self.mlp.backward_s)
        return GemmRate(rf, rb, cf, cb)

    def dense_mlp_s(self) -> tuple[float, float]:
        """(forward, backward) of the dense MLP a MoE layer replaces."""
        b, s = self.micro_batch, self.seq_len * self.token_scale
        return (self.time_scale * eval_fit(self.mlp.forward_s, b, s),
                self.time_scale * eval_fit(self.mlp.backward_s, b, s))

    def rows(self) -> tuple[float, ...]:
        """Each expert's expected rows in one micro-batch, in the trained model's tokens."""
        return expert_rows(self.routing, self.micro_batch * self.seq_len)

    def _routed_flops(self, router_tokens: float, rows: float, width_share: float) -> float:
        """Forward FLOPs of the router on ``router_tokens`` priced tokens and of ``rows`` priced expert rows at
        ``width_share`` of an expert's width."""
        h, moe = self.shapes.hidden_size, self.shapes.moe
        return (2.0 * router_tokens * h * self.routing.num_experts
                + 6.0 * rows * h * moe.expert_ffn_size * width_share)

    def _shared_flops(self) -> float:
        h, moe = self.shapes.hidden_size, self.shapes.moe
        return 6.0 * self.tokens * h * moe.shared_width / self.tp + (2.0 * self.tokens * h if moe.shared_gate else 0.0)

    def routed_tp_s(self) -> tuple[float, float]:
        """(forward, backward) of the router and the routed experts split over the TP group: every rank routes
        every token and computes every routed row on its 1/tp width slice."""
        by_expert = self.rows()
        calls = 1 + sum(1 for r in by_expert if r > 0)
        return self.rate.seconds(self._routed_flops(self.tokens, self.token_scale * sum(by_expert), 1 / self.tp),
                                   calls)

    def tp_delta_s(self) -> tuple[float, float]:
        """(forward, backward) a TP-split MoE layer adds to the dense layer: its MLP replaced by the router,
        the routed experts and the shared experts."""
        (rf, rb), (df, db) = self.routed_tp_s(), self.dense_mlp_s()
        sf, sb = self.rate.seconds(self._shared_flops(), 1 if self.shapes.moe.shared_width else 0)
        return rf + sf - df, rb + sb - db

    def device_s(self, n: int, rows: float, experts: int) -> tuple[float, float]:
        """(forward, backward) of one device of an expert-parallel stage of ``n`` devices (this object at TP 1):
        routing its 1/n of the tokens and running ``experts`` experts on ``rows`` rows in all (trained-model
        rows), whole."""
        return self.rate.seconds(self._routed_flops(self.tokens / n, self.token_scale * rows, 1.0), 1 + experts)

    def row_s(self) -> float:
        """Seconds one (token, expert) row of the trained model costs here, forward + backward, at full width."""
        rate = self.rate
        return ((rate.forward_per_flop + rate.backward_per_flop) * 6.0 * self.token_scale
                * self.shapes.hidden_size * self.shapes.moe.expert_ffn_size)

"""Whole-decoder-layer timings (what Megatron's and DeepSpeed's profilers report) split into the components
the cost model prices.

The rule (docs/profiles.md, "Whole-layer rows"): at every measured point (TP degree, micro-batch size,
sequence length) a layer's forward time is shared among its attention, its MLP and its two RMSNorms in the
proportions of their derived times on the profile's own throughput figures (``analytic_components``: FLOPs
at the matmul and attention efficiencies, bytes at the memory bandwidth, kernel overheads); the backward
time likewise by the derived backward times. The measured total is kept exactly; only its split is modelled.
"""

from __future__ import annotations

from runtime.torchfree.profiling.profile import LAYER_COMPONENTS, ComputeFigures, analytic_components, eval_fit
from runtime.torchfree.profiling.tables import ComponentTable
from runtime.torchfree.spec.model import ModelSpec

LAYER_ROW = "layer"   # the component name of a whole-layer row
# How often each component runs in one decoder layer: attention, MLP, and two norms.
PER_LAYER = {"attention": 1, "mlp": 1, "norm": 2}


def layer_shares(model: ModelSpec, compute: ComputeFigures, tp: int, micro_batch: int, seq_len: int,
                 backward: bool) -> dict[str, float]:
    """Per component, the share of one layer's time one instance of it takes (the two norms' shares are
    each half of theirs): the rule of the module docstring."""
    fits = analytic_components(model, compute, tp)
    t = {c: eval_fit(fits[c].backward_s if backward else fits[c].forward_s, micro_batch, seq_len)
         for c in LAYER_COMPONENTS}
    total = sum(PER_LAYER[c] * t[c] for c in LAYER_COMPONENTS)
    if total <= 0:
        return {c: 1.0 / sum(PER_LAYER.values()) for c in LAYER_COMPONENTS}
    return {c: t[c] / total for c in LAYER_COMPONENTS}


def split_layer_table(table: ComponentTable, model: ModelSpec, compute: ComputeFigures, tp: int
                      ) -> dict[str, ComponentTable]:
    """A whole-layer table as attention, MLP and norm tables on the same grid (one norm instance each)."""
    out = {}
    for comp in LAYER_COMPONENTS:
        grids = []
        for backward, values in ((False, table.forward_s), (True, table.backward_s)):
            grids.append(tuple(tuple(v * layer_shares(model, compute, tp, b, s, backward)[comp]
                                     for s, v in zip(table.seq_lens, row))
                               for b, row in zip(table.micro_batches, values)))
        out[comp] = ComponentTable(table.micro_batches, table.seq_lens, grids[0], grids[1])
    return out

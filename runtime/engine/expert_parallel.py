"""Expert parallelism inside one stage: whole experts on their holders, tokens sent to them by all-to-all.

An expert-parallel stage (plan ``experts:``, docs/moe.md) runs attention, norms and shared experts as a TP
group, and gives each device whole routed experts, possibly uneven in number (a faster device holds more)
and possibly replicated (a hot expert on two devices). A MoE block's input, the micro-batch's T tokens, is
the same on every device of the stage. Each MoE block then:

1. cuts the tokens in n equal slices (n devices; ``torch.chunk``), each device keeping its own slice
   (backward: the slices' gradients all-gathered, so the block's input gradient is whole everywhere);
2. routes its slice (the router is on every device; its gradient is a summand per device, which the
   gradient sync adds up: annotations/from_plan.py ``stage_member``);
3. all-gathers how many of its (token, expert) pairs go to each expert, so every device knows the
   [n, E] count matrix: the split sizes of both exchanges, which tokens a capacity keeps, and the global
   expert loads of the balance loss;
4. sends each kept pair's token to a holder of its expert by ``all_to_all_single`` (dropless: every pair;
   under a capacity factor an expert keeps its first ``capacity`` pairs in token order, as on one device);
   a replicated expert's holders share the senders, source rank s sending to holder ``s mod m``;
5. runs each expert it holds on every row it received for it, in one batch (source order: token order),
   and sends the results back by the reverse exchange (the backward of each exchange is the other one);
6. combines its slice (each token's expert outputs times their router weights, added in expert order as
   on one device), and all-gathers the slices into the whole block output (backward: its own rows).

Every device of the stage runs every step of this for every MoE block of every micro-batch, in the same
order, so the collectives pair up; the result equals the single-device block's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from runtime.comm.execute import all_gather_flat
from runtime.models.moe import MoeBlock, MoeForCausalLM
from runtime.torchfree.spec.plan import expert_destination


@dataclass(frozen=True)
class ExpertRoutes:
    """Where each expert's tokens go, by rank in the stage's group: ``placement[r]`` the experts rank r
    holds; source rank s sends expert e's tokens to ``dest[s][e]``."""

    placement: tuple[tuple[int, ...], ...]
    num_experts: int

    def __post_init__(self) -> None:
        unheld = [e for e in range(self.num_experts) if not self.holders(e)]
        if unheld:
            raise ValueError(f"experts {unheld} have no holder in placement {self.placement}")

    @property
    def size(self) -> int:
        return len(self.placement)

    def holders(self, expert: int) -> tuple[int, ...]:
        return tuple(r for r, held in enumerate(self.placement) if expert in held)

    def dest(self, source: int, expert: int) -> int:
        return expert_destination(self.holders(expert), source)


class _Slice(torch.autograd.Function):
    """Rows [lo, hi) of a tensor that is the same on every rank; backward: all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lo: int, hi: int, chunk: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.rows, ctx.chunk, ctx.group = x.shape[0], chunk, group
        return x[lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _gather_rows(grad, ctx.rows, ctx.chunk, ctx.group), None, None, None, None


class _Gather(torch.autograd.Function):
    """All ranks' row slices, concatenated (the same on every rank); backward: this rank's rows of the
    gradient (which every rank holds whole and equal)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, lo: int, chunk: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.lo, ctx.hi = lo, lo + x.shape[0]
        return _gather_rows(x, rows, chunk, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad[ctx.lo:ctx.hi], None, None, None, None


def _gather_rows(x: torch.Tensor, rows: int, chunk: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` (at most ``chunk`` rows each, the last ones fewer) stacked: ``rows`` rows."""
    n = dist.get_world_size(group)
    padded = x.new_zeros((chunk, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty(n * padded.numel())
    all_gather_flat(out, padded.reshape(-1), group=group)
    return out.view(n * chunk, *x.shape[1:])[:rows]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def kept_pairs(counts: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """[n, E] pairs each source rank keeps per expert: all of them, or under a capacity the first
    ``capacity`` of each expert in source order (source slices are in token order)."""
    if capacity is None:
        return counts
    before = torch.cumsum(counts, dim=0) - counts
    return torch.clamp(torch.clamp(capacity - before, min=0), max=counts)


class ExpertExchange:
    """The token exchange of one expert-parallel stage, shared by all its MoE blocks (``MoeBlock.exchange``).

    Every step of the routing is a tensor operation over pairs or experts (no Python loop over the E
    experts but the one calling the experts this device holds): DeepSeek-sized layers route to 256.
    """

    def __init__(self, routes: ExpertRoutes, group: dist.ProcessGroup) -> None:
        self.routes = routes
        self.group = group
        self.rank = dist.get_rank(group)
        n, e = routes.size, routes.num_experts
        # dest[s, e]: the rank source s sends expert e's tokens to.
        self.dest = torch.tensor([[routes.dest(s, x) for x in range(e)] for s in range(n)])
        # What this rank receives, segment by segment: (source, expert) pairs in source order, experts
        # ascending within a source (the order each source sends in).
        incoming = [(src, x) for src in range(n) for x in range(e) if routes.dest(src, x) == self.rank]
        self.in_source = torch.tensor([src for src, _ in incoming], dtype=torch.long)
        self.in_expert = torch.tensor([x for _, x in incoming], dtype=torch.long)

    def __call__(self, block: MoeBlock, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, me, num = self.routes.size, self.rank, self.routes.num_experts
        rows = flat.shape[0]
        chunk = -(-rows // n)
        lo, hi = min(me * chunk, rows), min((me + 1) * chunk, rows)
        x = _Slice.apply(flat, lo, hi, chunk, self.group)
        probs, chosen, weights = block.router.route(block.router(x))
        k = chosen.shape[-1]
        # 3. The count matrix (and the routers' summed probabilities, for the logged balance loss).
        mine = torch.cat([torch.bincount(chosen.reshape(-1), minlength=num).to(torch.float64),
                          probs.detach().sum(dim=0).to(torch.float64)])
        table = mine.new_empty(n * 2 * num)
        all_gather_flat(table, mine, group=self.group)
        table = table.view(n, 2 * num)
        counts = table[:, :num].round().long().cpu()   # split sizes are host integers: one sync per block
        kept = kept_pairs(counts, block.moe.capacity(rows))
        send = torch.bincount(self.dest[me], weights=kept[me].double(), minlength=n).long().tolist()
        recv = (kept * (self.dest == me)).sum(dim=1).tolist()
        # 4. This slice's kept pairs (the first kept[me, e] of each expert's, in token order), ordered by
        # destination, then expert, then token.
        pairs = self._kept_pairs(chosen.reshape(-1), counts[me], kept[me])
        tokens = x[pairs // k]
        if torch.is_autocast_enabled(tokens.device.type):  # the experts compute in it: send half the bytes
            tokens = tokens.to(torch.get_autocast_dtype(tokens.device.type))
        received = _AllToAll.apply(tokens, send, recv, self.group)
        # 5. Each held expert on its rows from every source, in source (= token) order.
        results = self._run_experts(block, received, kept)
        back = _AllToAll.apply(results, recv, send, self.group)
        # 6. Combine in expert order (the single-device order of additions), then gather the slices.
        w = weights.reshape(-1)[pairs].unsqueeze(-1)
        by_expert = torch.argsort(chosen.reshape(-1)[pairs], stable=True)
        out = torch.zeros_like(x)
        out = out.index_add(0, (pairs // k)[by_expert], (back * w)[by_expert].to(out.dtype))
        full = _Gather.apply(out, rows, lo, chunk, self.group)
        return full, self._balance_loss(probs, counts, table[:, num:].sum(dim=0), rows, k)

    def _kept_pairs(self, chosen: torch.Tensor, counts: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Indices into the slice's (token, slot) pairs ``chosen`` that are sent, in sending order."""
        device = chosen.device
        order = torch.argsort(chosen, stable=True)        # by expert, token order within
        expert = chosen[order]
        starts = (torch.cumsum(counts, 0) - counts).to(device)
        keep = torch.arange(order.numel(), device=device) - starts[expert] < kept.to(device)[expert]
        order, expert = order[keep], expert[keep]
        return order[torch.argsort(self.dest[self.rank].to(device)[expert], stable=True)]

    def _run_experts(self, block: MoeBlock, received: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """The held experts' outputs for ``received`` (segments by source, then expert), in its row order."""
        sizes = kept[self.in_source, self.in_expert]
        row_expert = torch.repeat_interleave(self.in_expert, sizes)
        if row_expert.numel() == 0:  # still on the autograd graph: the reverse exchange's backward pairs up everywhere
            return received[:0]
        order = torch.argsort(row_expert, stable=True)  # by expert, source (= token) order within
        per_expert = torch.bincount(row_expert, minlength=self.routes.num_experts).tolist()
        starts = list(itertools.accumulate(per_expert, initial=0))
        order = order.to(received.device)
        outs = [expert(received[order[starts[e]:starts[e + 1]]])
                for e, expert in sorted(block.held_experts().items()) if per_expert[e]]
        return torch.cat(outs)[torch.argsort(order)]

    @staticmethod
    def _balance_loss(probs: torch.Tensor, counts: torch.Tensor, prob_sums: torch.Tensor, rows: int,
                      k: int) -> torch.Tensor:
        """The block's balance loss (``moe.balance_loss`` over all T tokens) as its value, with the gradient of
        this rank's share: the other shares' gradients come from their own ranks."""
        num = probs.shape[-1]
        share = (counts.sum(dim=0).to(probs.device, probs.dtype) / (rows * k))
        local = num * torch.sum(share * probs.sum(dim=0) / rows)
        whole = num * torch.sum(share * prob_sums.to(probs.device, probs.dtype) / rows)
        return local + (whole - local).detach()


def apply_expert_parallel(module: nn.Module, placement: Sequence[tuple[int, ...]], devices: Sequence[int],
                          group: dist.ProcessGroup, group_devices: Sequence[int]) -> None:
    """Give every MoE block of ``module`` (a stage's chunk) the stage's token exchange. ``placement``: the
    experts of each of the stage's ``devices``; ``group_devices``: the group's members in its rank order."""
    if not isinstance(module, MoeForCausalLM):
        return
    by_device = dict(zip(devices, placement))
    routes = ExpertRoutes(tuple(tuple(by_device[d]) for d in group_devices), module.spec.moe.num_experts)
    exchange = ExpertExchange(routes, group)
    for block in module.moe_blocks():
        block.exchange = exchange

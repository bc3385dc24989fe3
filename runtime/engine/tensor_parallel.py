"""The bottom tier: Megatron tensor parallelism inside one stage's TP group, with DTensor.

Which style each parameter gets follows its ``ParamInfo.tp_dim`` (the parameter table), never its name:
a Linear split on dim 0 (output features) is column parallel, on dim 1 (input features) row parallel;
an Embedding split on dim 0 is vocab parallel (a row-parallel lookup whose partial outputs are summed).
The head is column parallel with its logits all-gathered, so the loss sees full rows. Parameters with
``tp_dim`` None (the norms) stay plain replicated tensors: every TP rank computes the same gradient.

Sequence parallelism (``training.sequence_parallel``, Megatron's and torchtitan's layout): inside a stage
the residual stream between the blocks is sharded along the sequence (dim 1), each TP rank holding
``seq / tp`` tokens as a plain local tensor; the decoder layers' norms run on that shard (DTensor
``SequenceParallel``, their weights replicated DTensors whose partial gradients the engine sums), each
block's input is all-gathered once before its column-parallel projections, and the row-parallel
projections reduce-scatter instead of all-reducing. At the stage's ends the boundary protocol's layout
stays as it is: the input is scattered before the first layer (its gradient all-gathered back) and the
last layer's output all-gathered (the final norm, the head and the embedding run as without it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from runtime.torchfree.models.params import ParamInfo

SEQUENCE_DIM = 1   # hidden states are [batch, seq, hidden]


def tp_style(module: nn.Module, info: ParamInfo, sequence_parallel: bool = False) -> ParallelStyle:
    """The DTensor parallel style that shards ``module``'s weight along ``info.tp_dim``; under sequence
    parallelism a decoder layer's row-parallel projections reduce-scatter along the sequence."""
    style: ParallelStyle
    if isinstance(module, nn.Embedding) and info.tp_dim == 0:
        style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    elif isinstance(module, nn.Linear) and info.tp_dim == 0:
        # The head's logits are gathered: the loss needs whole vocabulary rows.
        # (A Linear holding a tied embedding's weight is the head.)
        style = ColwiseParallel(output_layouts=Replicate() if info.owner == "head" or info.tied else Shard(-1))
    elif isinstance(module, nn.Linear) and info.tp_dim == 1:
        sharded = sequence_parallel and info.owner == "layer"
        style = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM)) if sharded else RowwiseParallel()
    else:
        raise ValueError(f"{info.name}: no tensor-parallel style for {type(module).__name__} split on "
                         f"dim {info.tp_dim}")
    # Every rank initialised the same full weight: slice locally instead of scattering from rank 0.
    style.src_data_rank = None
    return style


def apply_tensor_parallel(model: nn.Module, params: Iterable[ParamInfo], mesh: DeviceMesh,
                          sequence_parallel: bool = False) -> None:
    """Shard ``model`` (a stage, full weights on every rank) over the 1-D TP ``mesh`` in place; with
    ``sequence_parallel`` its decoder layers also shard the sequence (the module docstring)."""
    params = list(params)
    plan: dict[str, ParallelStyle] = {}
    blocks: set[str] = set()
    norms: set[str] = set()   # a decoder layer's modules whose parameters are all whole on every rank
    ties: list[tuple[str, str, str]] = []  # (module, attribute, module owning the parameter)
    # MoE blocks (the routers' parents) run on the flattened tokens of the whole sequence: under sequence
    # parallelism they take the gathered sequence and give back this rank's share (``_moe_sequence``), and
    # the projections inside them all-reduce as without it.
    moe_blocks = {info.name.rsplit(".", 2)[0] for info in params if info.router}

    def in_moe(name: str) -> bool:
        return any(name.startswith(b + ".") for b in moe_blocks)

    for info in params:
        module_name, attr = info.name.rsplit(".", 1)
        if info.tp_dim is None:
            module = model.get_submodule(module_name)
            if info.owner == "layer" and not isinstance(module, (nn.Linear, nn.Embedding)):
                norms.add(module_name)
            continue
        module = model.get_submodule(module_name)
        param = model.get_parameter(info.name)
        if getattr(module, attr) is not param:
            raise ValueError(f"{info.name}: not the weight of module {module_name}")
        plan[module_name] = tp_style(module, info, sequence_parallel and not in_moe(module_name))
        if isinstance(module, nn.Linear) and info.tp_dim == 0 and info.owner == "layer" and "." in module_name:
            blocks.add(module_name.rsplit(".", 1)[0])
        for other_name, other in model.named_modules():  # a tied head: the same weight in a second module
            if other is not module and getattr(other, attr, None) is param:
                plan[other_name] = tp_style(other, info, sequence_parallel and not in_moe(other_name))
                ties.append((other_name, attr, module_name))
    if sequence_parallel:
        for name in norms:
            plan[name] = SequenceParallel(sequence_dim=SEQUENCE_DIM)
    parallelize_module(model, mesh, plan)
    # parallelize_module gave each module its own sharded copy: make the tied module share the owner's again.
    for other_name, attr, module_name in ties:
        setattr(model.get_submodule(other_name), attr, getattr(model.get_submodule(module_name), attr))
    for name in sorted(blocks):
        model.get_submodule(name).register_forward_pre_hook(_replicated_input(mesh))
    if sequence_parallel:
        # The decoder layers, in the model's order: the parents of the blocks (a MoE block's own, not those
        # of the experts inside it).
        parents = {b.rsplit(".", 1)[0] for b in {*blocks, *moe_blocks} if "." in b and not in_moe(b)}
        layers = [m for n, m in model.named_modules() if n in parents]
        if layers:
            layers[0].register_forward_pre_hook(_scatter_sequence(mesh))
            layers[-1].register_forward_hook(_gather_sequence(mesh))
        for name in sorted(moe_blocks):
            gather, scatter = _moe_sequence(mesh)
            block = model.get_submodule(name)
            block.register_forward_pre_hook(gather)
            block.register_forward_hook(scatter)


def _replicated_input(mesh: DeviceMesh):
    """Make a block's input one replicated DTensor before its column-parallel projections read it.

    Each projection would otherwise wrap the plain tensor itself, and each backward would all-reduce its
    own input gradient (q, k, v: three all-reduces). Shared, the partial gradients add up first and one
    all-reduce per block remains, as in Megatron.
    """

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        if isinstance(args[0], DTensor):
            if args[0].placements == (Replicate(),):
                return None
            # Sequence parallel: a norm's sequence-sharded output, gathered once for the whole block (its
            # gradient comes back reduce-scattered).
            return (args[0].redistribute(mesh, (Replicate(),)), *args[1:])
        x = DTensor.from_local(args[0], mesh, (Replicate(),), run_check=False)
        return (x, *args[1:])

    return hook


def _moe_sequence(mesh: DeviceMesh):
    """A MoE block under sequence parallelism: (pre-hook) its input, this rank's share of the sequence, gathered
    whole (the backward keeps this rank's share of the gradient, which the block computes whole and the same on
    every rank), and (hook) its output, whole on every rank, cut back to this rank's share (the backward
    gathers the shares' gradients)."""

    def gather(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        shard = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(SEQUENCE_DIM),), run_check=False)
        return (shard.redistribute(mesh, (Replicate(),)).to_local(), *args[1:])

    def scatter(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(out, mesh, (Replicate(),), run_check=False)
        return whole.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local()

    return gather, scatter


def _scatter_sequence(mesh: DeviceMesh):
    """Before a stage's first decoder layer: keep this rank's share of the replicated hidden states' sequence.
    Through DTensor, so that the backward all-gathers the input gradient whole on every rank, as the
    boundary protocol sends it."""

    def hook(_module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        tp = mesh.size()
        if x.shape[SEQUENCE_DIM] % tp:
            raise ValueError(f"sequence parallelism: sequence length {x.shape[SEQUENCE_DIM]} is not divisible by "
                             f"the TP degree {tp}")
        full = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return (full.redistribute(mesh, (Shard(SEQUENCE_DIM),)).to_local(), *args[1:])

    return hook


def _gather_sequence(mesh: DeviceMesh):
    """After a stage's last decoder layer: the whole sequence again on every rank (an all-gather; its
    gradient, the same on every rank, is sliced back)."""

    def hook(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        shard = DTensor.from_local(out, mesh, (Shard(SEQUENCE_DIM),), run_check=False)
        return shard.redistribute(mesh, (Replicate(),)).to_local()

    return hook


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) tensor, sharing storage with it."""
    return t._local_tensor if isinstance(t, DTensor) else t


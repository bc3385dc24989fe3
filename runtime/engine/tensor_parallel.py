"""The bottom tier: Megatron tensor parallelism inside one stage's TP group, with DTensor.

Which style each parameter gets follows its ``ParamInfo.tp_dim`` (the parameter table), never its name:
a Linear split on dim 0 (output features) is column parallel, on dim 1 (input features) row parallel;
an Embedding split on dim 0 is vocab parallel (a row-parallel lookup whose partial outputs are summed).
The head is column parallel with its logits all-gathered, so the loss sees full rows. Parameters with
``tp_dim`` None (the norms) stay plain replicated tensors: every TP rank computes the same gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from runtime.models.params import ParamInfo


def tp_style(module: nn.Module, info: ParamInfo) -> ParallelStyle:
    """The DTensor parallel style that shards ``module``'s weight along ``info.tp_dim``."""
    style: ParallelStyle
    if isinstance(module, nn.Embedding) and info.tp_dim == 0:
        style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    elif isinstance(module, nn.Linear) and info.tp_dim == 0:
        # The head's logits are gathered: the loss needs whole vocabulary rows.
        # (A Linear holding a tied embedding's weight is the head.)
        style = ColwiseParallel(output_layouts=Replicate() if info.owner == "head" or info.tied else Shard(-1))
    elif isinstance(module, nn.Linear) and info.tp_dim == 1:
        style = RowwiseParallel()
    else:
        raise ValueError(f"{info.name}: no tensor-parallel style for {type(module).__name__} split on "
                         f"dim {info.tp_dim}")
    # Every rank initialised the same full weight: slice locally instead of scattering from rank 0.
    style.src_data_rank = None
    return style


def apply_tensor_parallel(model: nn.Module, params: Iterable[ParamInfo], mesh: DeviceMesh) -> None:
    """Shard ``model`` (a stage, full weights on every rank) over the 1-D TP ``mesh`` in place."""
    plan: dict[str, ParallelStyle] = {}
    blocks: set[str] = set()
    ties: list[tuple[str, str, str]] = []  # (module, attribute, module owning the parameter)
    for info in params:
        if info.tp_dim is None:
            continue
        module_name, attr = info.name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        param = model.get_parameter(info.name)
        if getattr(module, attr) is not param:
            raise ValueError(f"{info.name}: not the weight of module {module_name}")
        plan[module_name] = tp_style(module, info)
        if isinstance(module, nn.Linear) and info.tp_dim == 0 and info.owner == "layer" and "." in module_name:
            blocks.add(module_name.rsplit(".", 1)[0])
        for other_name, other in model.named_modules():  # a tied head: the same weight in a second module
            if other is not module and getattr(other, attr, None) is param:
                plan[other_name] = tp_style(other, info)
                ties.append((other_name, attr, module_name))
    parallelize_module(model, mesh, plan)
    # parallelize_module gave each module its own sharded copy: make the tied module share the owner's again.
    for other_name, attr, module_name in ties:
        setattr(model.get_submodule(other_name), attr, getattr(model.get_submodule(module_name), attr))
    for name in sorted(blocks):
        model.get_submodule(name).register_forward_pre_hook(_replicated_input(mesh))


def _replicated_input(mesh: DeviceMesh):
    """Make a block's input one replicated DTensor before its column-parallel projections read it.

    Each projection would otherwise wrap the plain tensor itself, and each backward would all-reduce its
    own input gradient (q, k, v: three all-reduces). Shared, the partial gradients add up first and one
    all-reduce per block remains, as in Megatron.
    """

    def hook(_module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
            return None
        x = DTensor.from_local(args[0], mesh, (Replicate(),), run_check=False)
        return (x, *args[1:])

    return hook


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) tensor, sharing storage with it."""
    return t._local_tensor if isinstance(t, DTensor) else t


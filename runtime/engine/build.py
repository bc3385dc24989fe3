"""Building one model chunk of a stage without ever holding the unsharded stage.

The chunk's module is created on the meta device (shapes only), sharded there by the TP plan, then given
uninitialised storage for this rank's shards on the target device (``to_empty``); each parameter's full
initial value is then made on the CPU one at a time (``LlamaForCausalLM.init_weights``: name-seeded, the
reference's numbers) and only this rank's region of it is copied in. Peak memory is the local shards on
the device plus one full parameter on the host, whatever the stage's size or TP degree.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh

from runtime.engine.tensor_parallel import apply_tensor_parallel, local_tensor
from runtime.models.llama import LlamaForCausalLM
from runtime.models.moe import causal_lm
from runtime.torchfree.engine.specialize import ChunkRole, ParamShard, chunk_parameters
from runtime.torchfree.spec.model import ModelSpec


def build_chunk(spec: ModelSpec, chunk: ChunkRole, shards: Mapping[str, ParamShard], *, seed: int,
                device: torch.device, mesh: DeviceMesh | None, sequence_parallel: bool = False,
                experts: tuple[int, ...] | None = None) -> LlamaForCausalLM:
    """This rank's module of ``chunk``: its shards (``shards``, by parameter name) on ``device``,
    initialised to their part of the single-device reference's initial weights; on an expert-parallel
    stage holding only ``experts`` of the routed experts, whole."""
    with torch.device("meta"):
        module = causal_lm(spec, range(*chunk.layers), embed=chunk.embed, head=chunk.head, experts=experts)
    if mesh is not None:
        apply_tensor_parallel(module, chunk_parameters(spec, chunk, experts), mesh, sequence_parallel)
    tied = _tied_pairs(module)
    module.to_empty(device=device)
    for owner, owner_attr, other, attr in tied:  # to_empty may give each module its own tensor: share again
        setattr(other, attr, getattr(owner, owner_attr))

    def fill(name: str, param: torch.Tensor, value: torch.Tensor) -> None:
        shard = shards.get(name)
        if shard is None:
            raise AssertionError(f"{name}: held by the chunk's module but not among this device's shards")
        local_tensor(param).copy_(value[shard.region])

    module.init_weights(seed, fill)
    return module


def _tied_pairs(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """(owner, its attribute, other module, its attribute) for every parameter that a second module holds too."""
    first: dict[int, tuple[torch.nn.Module, str]] = {}
    out = []
    for sub in module.modules():
        for attr, p in sub.named_parameters(recurse=False):
            if id(p) in first:
                owner, owner_attr = first[id(p)]
                out.append((owner, owner_attr, sub, attr))
            else:
                first[id(p)] = (sub, attr)
    return out

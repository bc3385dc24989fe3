"""All process groups of one world, created in one global order on every rank.

torch.distributed requires every rank to call ``new_group`` for every group, in the same order, even
for groups it is not a member of. Creating them all here, from one sorted list, makes that order a
property of the list rather than of the code paths that happen to need a group.
Groups are named by device ids; ``ranks`` maps device ids to the ranks of the current world (after a
failure the survivors form a new world with new ranks, the device ids stay).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

DeviceGroupKey = tuple[int, ...]


def canonical(devices: Iterable[int]) -> DeviceGroupKey:
    return tuple(sorted(set(devices)))


class ProcessGroups:
    """Registry of process groups keyed by (sorted) device-id tuples."""

    def __init__(self, groups: Iterable[Sequence[int]], ranks: Mapping[int, int], *,
                 timeout: timedelta, backend: str | None = None,
                 device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before creating process groups")
        self.ranks = dict(ranks)
        self.timeout = timeout
        self.backend = backend
        # Where this rank's communication buffers live (cuda:local_rank under NCCL); comm ops use it
        # for tensors they allocate on devices that receive without holding an input.
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.my_rank = dist.get_rank()
        self._device_of_rank = {r: d for d, r in self.ranks.items()}
        self.my_device = self._device_of_rank.get(self.my_rank)
        self._groups: dict[DeviceGroupKey, dist.ProcessGroup | None] = {}
        self._meshes: dict[DeviceGroupKey, object] = {}
        self.ensure(groups)

    def ensure(self, groups: Iterable[Sequence[int]]) -> None:
        """Create the groups not created yet, in the global order. Collective: every rank of the world
        must call it with the same groups (as the constructor)."""
        keys = sorted({canonical(g) for g in groups if len(set(g)) > 1} - set(self._groups),
                      key=lambda k: (len(k), k))
        unknown = sorted({d for k in keys for d in k if d not in self.ranks})
        if unknown:
            raise ValueError(f"groups name devices {unknown} that have no rank in this world")
        for key in keys:
            pg = dist.new_group([self.ranks[d] for d in key], timeout=self.timeout, backend=self.backend)
            self._groups[key] = pg if self.my_device in key else None

    def __contains__(self, devices: object) -> bool:
        return isinstance(devices, Iterable) and canonical(devices) in self._groups  # type: ignore[arg-type]

    @property
    def keys(self) -> list[DeviceGroupKey]:
        return list(self._groups)

    def get(self, devices: Iterable[int]) -> dist.ProcessGroup:
        """The group of these devices; this device must be a member."""
        key = canonical(devices)
        if key not in self._groups:
            raise KeyError(f"no process group was created for devices {key}")
        pg = self._groups[key]
        if pg is None:
            raise KeyError(f"device {self.my_device} is not a member of group {key}")
        return pg

    def order(self, pg: dist.ProcessGroup) -> list[int]:
        """The device ids of a group's members, in the group's rank order."""
        return [self._device_of_rank[r] for r in dist.get_process_group_ranks(pg)]

    def mesh(self, devices: Sequence[int], device_type: str = "cpu"):
        """A 1-D DeviceMesh over an existing group (the bottom tier of a subgroup), in the given order."""
        from torch.distributed.device_mesh import DeviceMesh

        key = tuple(devices)
        if key not in self._meshes:
            pg = self.get(devices)
            ranks = [self.ranks[d] for d in devices]
            if ranks != sorted(ranks):
                raise ValueError(f"mesh devices {key} must be in rank order to reuse the group")
            self._meshes[key] = DeviceMesh.from_group(pg, device_type)
        return self._meshes[key]

    def forget(self) -> None:
        """Drop the groups without destroying them: torch holds them no more (their world was aborted,
        runtime/comm/abort.py)."""
        self._groups.clear()
        self._meshes.clear()

    def destroy(self) -> None:
        for pg in self._groups.values():
            if pg is not None:
                dist.destroy_process_group(pg)
        self._groups.clear()
        self._meshes.clear()

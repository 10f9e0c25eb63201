"""The TP × DP × PP process groups of the one rank layout (``dscompile.planner.ParallelLayout``: pipeline stages
outermost, tensor parallelism innermost, as DeepSpeed and Megatron lay them out). Every rank creates every group
(``dist.new_group`` is collective) in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from dscompile.planner import ParallelLayout

__all__ = ["ParallelLayout", "ProcessGroups", "build_process_groups", "current_process_groups", "process_groups_for", "set_current_process_groups"]


@dataclass
class ProcessGroups:
    """This rank's groups (None where a group would be the whole world of one rank, or without torch.distributed)."""

    layout: ParallelLayout
    rank: int
    tp_group: Any = None
    dp_group: Any = None
    pp_group: Any = None
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    pp_ranks: list[int] = field(default_factory=list)

    @property
    def tp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[2]

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size


_current: tuple[Any, ProcessGroups] | None = None  # (the world's group, the layout last built): what ``deepspeed.utils.groups`` reports


def _world_group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def current_process_groups() -> ProcessGroups | None:
    """The groups the last ``build_process_groups`` (or an mpu) laid out in this process group; None before any."""
    if _current is None or _current[0] is not _world_group():  # laid out in a process group since destroyed
        return None
    return _current[1]


def set_current_process_groups(groups: ProcessGroups | None) -> None:
    global _current
    _current = (_world_group(), groups) if groups is not None else None


def process_groups_for(tp_size: int) -> ProcessGroups:
    """The current groups when they already lay out ``tp_size`` (``tp_model_init`` built them), else new ones."""
    current = current_process_groups()
    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else 1
    if current is not None and current.tp_size == tp_size and current.layout.pp_size == 1 and current.layout.world_size == world:
        return current
    return build_process_groups(tp_size)


def build_process_groups(tp_size: int = 1, pp_size: int = 1, *, current: bool = True) -> ProcessGroups:
    """Create the TP, DP and PP groups of the current world (every rank must call it, in the same order).
    ``current``: they become what ``deepspeed.utils.groups`` reports (not for sequence groups laid out as TP's)."""
    initialized = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
    layout = ParallelLayout(world, tp_size, pp_size)
    groups = ProcessGroups(layout, rank)
    for kind, lists in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()), ("pp", layout.pp_groups())):
        for ranks in lists:
            group = dist.new_group(ranks) if initialized else None  # collective: every rank creates every group
            if rank in ranks:
                setattr(groups, f"{kind}_group", group)
                setattr(groups, f"{kind}_ranks", ranks)
    if current:
        set_current_process_groups(groups)
    return groups

"""``deepspeed.utils.groups``: the tensor- and data-parallel groups of the current layout.

They are the groups dscompile laid out (``tp_model_init``, an engine with ``tensor_parallel``, or
the ``mpu=`` a script passed), TP innermost as Megatron and DeepSpeed lay them out. Before any
layout, or without torch.distributed, tensor parallelism is of size 1 and data parallelism is the
whole world.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dscompile.runtime.process_groups import current_process_groups

__all__ = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tensor_model_parallel_group() -> Any:
    groups = current_process_groups()
    return groups.tp_group if groups is not None else None


def get_tensor_model_parallel_world_size() -> int:
    groups = current_process_groups()
    return groups.tp_size if groups is not None else 1


def get_tensor_model_parallel_rank() -> int:
    groups = current_process_groups()
    return groups.tp_rank if groups is not None else 0


def get_data_parallel_group() -> Any:
    groups = current_process_groups()
    if groups is not None:
        return groups.dp_group
    return dist.group.WORLD if _initialized() else None


def get_data_parallel_world_size() -> int:
    groups = current_process_groups()
    if groups is not None:
        return groups.dp_size
    return dist.get_world_size() if _initialized() else 1


def get_data_parallel_rank() -> int:
    groups = current_process_groups()
    if groups is not None:
        return groups.dp_rank
    return dist.get_rank() if _initialized() else 0


# DeepSpeed's older names for the tensor-parallel group
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank

"""``deepspeed.comm``: DeepSpeed's collective API, translated one for one to ``torch.distributed``.

The collectives accept DeepSpeed's extra keywords: ``log_name`` and ``debug`` label the comms
logger's records and are dropped (the logger is not built), ``prof=True`` asks for that logger and
is refused. Before a process group exists, ``get_rank``/``get_world_size``/``get_local_rank``
answer for a single process (0, 1, ``LOCAL_RANK`` or 0) instead of failing as DeepSpeed's do, so a
script also runs without a launcher.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.process_exit import init_process_group

log = logging.getLogger("dscompile.comm")

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

DEFAULT_PORT = 29500
"""DeepSpeed's ``TORCH_DISTRIBUTED_DEFAULT_PORT``: the rendezvous port when no launcher set one."""

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_logging_keywords(name: str, keywords: dict[str, Any]) -> None:
    """DeepSpeed's collectives take ``prof``, ``log_name`` and ``debug`` for its comms logger."""
    unknown = set(keywords) - {"prof", "log_name", "debug"}
    if unknown:
        raise TypeError(f"comm.{name}() got unexpected keyword arguments {sorted(unknown)}")
    if keywords.get("prof"):
        raise DSCompileNotSupportedError(f"comm.{name}(prof=True)", "DeepSpeed's comms logger (use torch.profiler)")


# -- process groups ----------------------------------------------------------------------------
def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group unless one exists (DeepSpeed's ``init_distributed``).

    The backend defaults to the accelerator's (NCCL on a GPU, gloo on the host). Ranks come from
    the launcher's environment (torchrun, ``deepspeed``), from ``rank``/``world_size``, or, with
    neither, a one-process group on ``distributed_port`` is made. MPI discovery is not built: a
    partial launcher environment is an error naming the missing variables.
    """
    if is_initialized():
        if dist_init_required:
            log.info("init_distributed: a process group already exists; keeping it")
        return
    if dist_init_required is False:
        raise DSCompileConfigError("dist_init_required", "is False but no process group exists", "call torch.distributed.init_process_group first, or drop it")
    from dscompile.accelerator import get_accelerator

    backend = dist_backend or get_accelerator().communication_backend_name()
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:
        kwargs["init_method"] = init_method
    if rank >= 0 or world_size >= 0:
        kwargs["rank"], kwargs["world_size"] = rank, world_size
    if init_method is None and rank < 0:
        present = [v for v in _LAUNCH_ENV if v in os.environ]
        if not present:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(distributed_port)})
        elif len(present) < len(_LAUNCH_ENV):
            missing = [v for v in _LAUNCH_ENV if v not in os.environ]
            raise DSCompileConfigError(
                "init_distributed", f"the launcher environment lacks {', '.join(missing)}", "launch with torchrun, or pass rank= and world_size="
            )
    if verbose and int(os.environ.get("RANK", "0")) == 0:
        log.info("init_distributed: torch.distributed.init_process_group(%s)", kwargs)
    init_process_group(**kwargs)  # destroyed again at exit (runtime/process_exit.py)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks=list(ranks))


def get_world_group() -> Any:
    return dist.group.WORLD


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """The launcher's ``LOCAL_RANK`` (the device index), 0 without a launcher."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return list(range(get_world_size())) if group is None else dist.get_process_group_ranks(group)


# -- collectives -------------------------------------------------------------------------------
def all_reduce(tensor: Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    """``ReduceOp.AVG`` also on gloo, which lacks it: summed, then divided by the group size."""
    _check_logging_keywords("all_reduce", logging)
    if op == ReduceOp.AVG and dist.get_backend(group) == "gloo":
        work = dist.all_reduce(tensor, op=ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
        return work
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


inference_all_reduce = all_reduce


def reduce(tensor: Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("reduce", logging)
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: Tensor, src: int, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("broadcast", logging)
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None, **logging: Any) -> Any:
    _check_logging_keywords("broadcast_object_list", logging)
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list: list[Tensor], tensor: Tensor, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("all_gather", logging)
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, **logging: Any) -> Any:
    _check_logging_keywords("all_gather_object", logging)
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: Tensor, tensor: Tensor, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("all_gather_into_tensor", logging)
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: Tensor, input_tensor: Tensor, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("allgather_fn", logging)
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def reduce_scatter_tensor(output_tensor: Tensor, tensor: Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("reduce_scatter_tensor", logging)
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: Tensor, tensor: Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op, **logging)


def reduce_scatter(output: Tensor, input_list: list[Tensor], op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("reduce_scatter", logging)
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def all_to_all_single(
    output: Tensor,
    tensor: Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
    **logging: Any,
) -> Any:
    _check_logging_keywords("all_to_all_single", logging)
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def gather(tensor: Tensor, gather_list: list[Tensor] | None = None, dst: int = 0, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("gather", logging)
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor: Tensor, scatter_list: list[Tensor] | None = None, src: int = 0, group: Any = None, async_op: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("scatter", logging)
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def send(tensor: Tensor, dst: int, group: Any = None, tag: int = 0, **logging: Any) -> Any:
    _check_logging_keywords("send", logging)
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: Tensor, src: int | None = None, group: Any = None, tag: int = 0, **logging: Any) -> Any:
    _check_logging_keywords("recv", logging)
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: Tensor, dst: int, group: Any = None, tag: int = 0, **logging: Any) -> Any:
    _check_logging_keywords("isend", logging)
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: Tensor, src: int | None = None, group: Any = None, tag: int = 0, **logging: Any) -> Any:
    _check_logging_keywords("irecv", logging)
    return dist.irecv(tensor, src, group=group, tag=tag)


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None, **logging: Any) -> Any:
    _check_logging_keywords("barrier", logging)
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False, **logging: Any) -> Any:
    _check_logging_keywords("monitored_barrier", logging)
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def get_backend(group: Any = None) -> str:
    return dist.get_backend(group)


def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: Any = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """DeepSpeed configures its comms logger here; refused when asked to log (it is not built)."""
    if enabled or prof_all or prof_ops:
        raise DSCompileNotSupportedError("comms_logger", "DeepSpeed's comms logger (use torch.profiler)")


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    raise DSCompileNotSupportedError("comm.log_summary", "DeepSpeed's comms logger (use torch.profiler)")

"""DeepSpeed's ``initialize(mpu=...)``: a model the script already split (Megatron-style), trained over the mpu's groups.

Megatron-DeepSpeed scripts partition their layers themselves (``ColumnParallelLinear`` /
``RowParallelLinear``, collectives in their forward) and hand DeepSpeed a *model-parallel unit*: an
object whose methods name the tensor-parallel and data-parallel groups. The engine then
- averages gradients (or shards ZeRO states) over the data-parallel group only, and starts the
  replicas of each slice equal by broadcasting inside that group (never across slices);
- clips by the norm of the whole model: the squares of split parameters summed over the TP group,
  replicated ones counted once (DeepSpeed reads the same ``tensor_model_parallel`` / ``model_parallel``
  attributes to tell them apart);
- saves one ``mp_rank_XX_model_states.pt`` per TP rank with each split parameter's ``partition_dim``, so
  ``dscompile zero-to-fp32`` joins the slices and an engine on another TP size loads the weights.

The groups must follow Megatron's default order (TP ranks consecutive, TP innermost), the layout
``runtime/process_groups.py`` computes; any other layout is refused with the ranks it found.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.gradient_strategy import GradientStrategy
from dscompile.runtime.process_groups import ParallelLayout, ProcessGroups, set_current_process_groups
from dscompile.runtime.tensor_parallel import SliceSpec
from dscompile.runtime.tensor_parallel_gradients import TensorParallelGradients, TensorParallelOver
from dscompile.runtime.training_core import TrainingCore


def _ask(mpu: Any, *names: str) -> Any:
    """The first of ``names`` the unit has, called (Megatron renamed ``model_parallel`` to ``tensor_model_parallel``)."""
    for name in names:
        method = getattr(mpu, name, None)
        if callable(method):
            return method()
    raise DSCompileConfigError(
        "mpu", f"the model-parallel unit {type(mpu).__name__} has none of {', '.join(names)}", "pass Megatron's mpu (megatron.core.parallel_state)"
    )


def mpu_groups(mpu: Any) -> tuple[Any, Any]:
    """The unit's tensor- and data-parallel groups (pipeline stages in it refused)."""
    pipeline = getattr(mpu, "get_pipeline_model_parallel_world_size", None)
    if callable(pipeline) and pipeline() > 1:
        raise DSCompileNotSupportedError("mpu", "a model-parallel unit with pipeline stages (use dscompile's pipeline section)")
    if not (dist.is_available() and dist.is_initialized()):
        raise DSCompileConfigError("mpu", "given without torch.distributed initialized", "launch with torchrun (or call dscompile.init_distributed() first)")
    return _ask(mpu, "get_tensor_model_parallel_group", "get_model_parallel_group"), _ask(mpu, "get_data_parallel_group")


def process_groups_from_mpu(mpu: Any, config: Any) -> ProcessGroups:
    """The TP and DP groups the unit names, checked against the TP-innermost layout dscompile computes."""
    tp_group, dp_group = mpu_groups(mpu)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_ranks = dist.get_process_group_ranks(tp_group)
    dp_ranks = dist.get_process_group_ranks(dp_group)
    layout = ParallelLayout(world, len(tp_ranks))
    expected_tp = next(g for g in layout.tp_groups() if rank in g)
    expected_dp = next(g for g in layout.dp_groups() if rank in g)
    if sorted(tp_ranks) != expected_tp or sorted(dp_ranks) != expected_dp:
        raise DSCompileNotSupportedError(
            "mpu",
            f"model-parallel groups laid out otherwise than TP innermost (rank {rank}: TP group {tp_ranks}, data-parallel group {dp_ranks}; "
            f"expected {expected_tp} and {expected_dp})",
        )
    groups = ProcessGroups(layout, rank, tp_group=tp_group, dp_group=dp_group, tp_ranks=expected_tp, dp_ranks=expected_dp)
    set_current_process_groups(groups)  # what deepspeed.utils.groups reports
    return groups


def model_parallel_slices(module: torch.nn.Module) -> dict[str, SliceSpec]:
    """The parameters the script split (Megatron's ``tensor_model_parallel`` or DeepSpeed's ``model_parallel``
    attribute) and the dimension they were split along (``partition_dim``)."""
    slices: dict[str, SliceSpec] = {}
    for name, p in module.named_parameters():
        if not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)):
            continue
        dim = getattr(p, "partition_dim", None)
        if not isinstance(dim, int) or not -p.dim() <= dim < p.dim():
            raise DSCompileConfigError(
                "mpu",
                f"parameter {name} is marked model-parallel but has no valid partition_dim ({dim!r})",
                "set it as Megatron's set_tensor_model_parallel_attributes(param, True, dim, 1) does",
            )
        if getattr(p, "partition_stride", 1) != 1:
            raise DSCompileNotSupportedError("mpu", f"strided partitions (parameter {name}: partition_stride {p.partition_stride})")
        slices[name] = SliceSpec(dim=dim % p.dim())
    return slices


def prepare_model_parallel(engine: TrainingCore, groups: ProcessGroups) -> None:
    """Before the extensions: the groups on the engine (ZeRO shards over ``dp_group``), the replicas of each slice equal."""
    engine.context.process_groups = groups
    engine.context.model_parallel_slices = model_parallel_slices(engine.module)
    if groups.dp_size > 1:
        with torch.no_grad():
            for tensor in list(engine.module.parameters()) + list(engine.module.buffers()):
                dist.broadcast(tensor, src=groups.dp_ranks[0], group=groups.dp_group)


def model_parallel_gradients(engine: TrainingCore, groups: ProcessGroups) -> GradientStrategy:
    """Data parallelism over the DP group with TP-aware norms and checkpoints, or the ZeRO strategy wrapped alike."""
    slices = engine.context.model_parallel_slices or {}
    if engine.gradients is None:
        return TensorParallelGradients(engine.module, groups, lambda: slices)
    return TensorParallelOver(engine.gradients, groups, lambda: slices)

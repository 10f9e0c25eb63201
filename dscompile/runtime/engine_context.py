"""The state engine extensions share, in one typed object the engine core owns (``engine.context``).

Extensions (``runtime/engine_extension.py``) never attach attributes to the engine: what one publishes for another,
or for the engine, is a field here, so every piece of shared state is declared once, with who writes and who reads
it. The training core shows the fields users, tests and checkpoints read as read-only properties
(``engine.zero``, ``engine.compile_target``, ...); writing one of those on the engine raises ``AttributeError``.
The core's own state (``optimizer``, ``gradients``, ``plan``, ``lr_scheduler``, the step counters) changes through its
methods (``replace_optimizer``, ``install_gradients``, ``replan``, ``install_lr_scheduler``, ``restore_counters``).
``tests/test_engine_context.py`` holds every module to this (extensions, checkpoint loading, ``initialize``, the
Hugging Face integration): none writes an attribute of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dscompile.runtime.process_groups import ProcessGroups
    from dscompile.runtime.zero_profile import ZeroProfiler
    from dscompile.runtime.zero_shard import ZeroPartition


@dataclass
class EngineContext:
    """What the engine and its extensions share; created by ``EngineCore.init_engine``. State no field covers yet
    becomes a new field here (with who writes and who reads it), never an engine attribute."""

    # what the engine compiles and calls: the engine writes its model; ZeRO-2/3 (a ZeroModule), 1-bit ZeRO (the model
    # again), TP and SP (their split modules) replace it; the engine compiles it, parameter offload reads it
    compile_target: nn.Module | None = None
    # the engine torch.compiles compile_target: the engine writes it; TP/SP clear it (their modules compile their own
    # graph); TP/SP and ZeRO profiling read it
    compiles_model: bool = False
    # the ZeroPartition when ZeRO is on: the ZeRO extension writes it; checkpoints, offload, TP gradients, tools read it
    zero: ZeroPartition | None = None
    # the TP x DP groups: a script's mpu (model_parallel_unit) or TP write them; ZeRO (its DP group), SP and the
    # training core's data-parallel size read them
    process_groups: ProcessGroups | None = None
    # a script's mpu: the parameters each rank holds a slice of; model_parallel_unit writes and reads it
    model_parallel_slices: dict[str, Any] | None = None
    # TP/SP split the parameters at the first batch: they set a list, ZeRO appends callbacks taking the split module
    # and returning the one to run (ZeRO partitions the split parameters then); TP/SP run them
    after_parameters_split: list[Callable[[nn.Module], nn.Module]] | None = None
    # ZeRO profiling's profiler (profile_steps): the ZeRO profile extension writes it; tests and tools read its report
    zero_profiler: ZeroProfiler | None = None
    # DeepSpeed's ZeRO computes the global gradient norm every step (zero_optimization.compute_grad_norm): the ZeRO
    # extension writes it; the training core's step reads it (otherwise the norm is computed only to clip)
    grad_norm_every_step: bool = False
    # dtype of the gradient reductions done outside graphs (communication_data_type): mixed precision writes it; the
    # gradient strategies (data parallel, ZeRO-1, pipeline, 1-bit ZeRO) read it; None reduces in the gradients' dtype
    communication_data_type: torch.dtype | None = None
    # the training precision (the dtype of save_16bit_model's copy; None: fp32): mixed precision writes it; the engines
    # read it (outputs' dtype, 16-bit saves, pipeline batches)
    compute_dtype: torch.dtype | None = None


# The fields the training core shows as read-only engine properties (read by users, tests and checkpoints).
ENGINE_VIEWS: tuple[str, ...] = (
    "compile_target",
    "compiles_model",
    "zero",
    "process_groups",
    "zero_profiler",
    "communication_data_type",
    "compute_dtype",
)


def refuse_engine_write(engine: Any, name: str) -> None:
    """``engine.zero = x`` and the like: the field is the context's, written by the extension that owns it."""
    if name in ENGINE_VIEWS:
        raise AttributeError(
            f"{type(engine).__name__}.{name} is read-only: it shows engine.context.{name}, which the extension that owns it "
            f"writes (see dscompile/runtime/engine_context.py)"
        )

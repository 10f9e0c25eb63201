"""The planner: every placement and layout decision, made once before compiling (DESIGN.md's one plan).

One module per job; the folder's ``README.md`` says which and the rules. Other code imports from here.
"""

from __future__ import annotations

from dscompile.planner.checkpointing import CheckpointingPlan, plan_activation_checkpointing
from dscompile.planner.context import PlannedConfig, checkpointing_of, compiling_under, zero_schedule_of
from dscompile.planner.inference import plan_inference
from dscompile.planner.layout import ParallelLayout
from dscompile.planner.offload import (
    FP32,
    TILE_BUFFER_SHARE,
    TILE_MAX_ELEMENTS,
    TILE_MIN_ELEMENTS,
    OffloadPlan,
    ParamPlan,
    PlannedParameter,
    PlanRow,
    fixed_model_state_bytes,
    non_shard_device_bytes,
    nvme_tile_elements,
    plan_optimizer_offload,
    plan_param_offload,
    zero_parameters,
)
from dscompile.planner.plan import PLAN_FILE, ZERO_BY_PARTITION, ZERO_BY_PIPELINE, ZERO_OFF, ParallelPlan, plan_parallel, write_plan
from dscompile.planner.zero_schedule import ZeroSchedule, plan_zero_schedule

__all__ = [
    "FP32",
    "PLAN_FILE",
    "TILE_BUFFER_SHARE",
    "TILE_MAX_ELEMENTS",
    "TILE_MIN_ELEMENTS",
    "ZERO_BY_PARTITION",
    "ZERO_BY_PIPELINE",
    "ZERO_OFF",
    "CheckpointingPlan",
    "OffloadPlan",
    "ParallelLayout",
    "ParallelPlan",
    "ParamPlan",
    "PlanRow",
    "PlannedConfig",
    "PlannedParameter",
    "ZeroSchedule",
    "checkpointing_of",
    "compiling_under",
    "fixed_model_state_bytes",
    "non_shard_device_bytes",
    "nvme_tile_elements",
    "plan_activation_checkpointing",
    "plan_inference",
    "plan_optimizer_offload",
    "plan_param_offload",
    "plan_parallel",
    "plan_zero_schedule",
    "write_plan",
    "zero_parameters",
    "zero_schedule_of",
]

"""Activation checkpointing on the joint graph: choose what forward saves and what backward recomputes.

One module per job (README.md has the layout, the method and the rules). Importing the package registers the
``activation_checkpointing`` config section, its config rule and then the ``checkpoint`` pass, in that order. The
names other code imports are re-exported here, a few private ones included (the tests and the benchmark read them).
Not to be confused with ``dscompile/checkpointing.py``: DeepSpeed's ``deepspeed.checkpointing`` API for scripts
that checkpoint by hand.
"""

from __future__ import annotations

from dscompile.cost import Roofline, is_matmul_class
from dscompile.passes.checkpointing.blocks import block_of, segments
from dscompile.passes.checkpointing.config import (
    ActivationCheckpointingConfig,
    CheckpointOptions,
    PartitionGroupMissingError,
    Policy,
)
from dscompile.passes.checkpointing.entry import checkpoint
from dscompile.passes.checkpointing.joint import (
    JointInfo,
    _aliases_first_input,
    _ban_reason,
    analyse_joint,
    is_alias,
    recompute_seconds,
    storage_base,
)
from dscompile.passes.checkpointing.measure import (
    _fill_missing_values,
    _unwrap_rng,
    copy_graph_module,
    measure_partition,
    no_checkpointing_saved_bytes,
)
from dscompile.passes.checkpointing.plan import Plan, apply_plan, plan_checkpointing
from dscompile.passes.checkpointing.reports import _LOGGED_ONCE, checkpoint_reports, clear_reports
from dscompile.passes.checkpointing.solver import Cut, CutSolver, solve_budget, solve_target

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointOptions",
    "Cut",
    "CutSolver",
    "JointInfo",
    "PartitionGroupMissingError",
    "Plan",
    "Policy",
    "Roofline",
    "_LOGGED_ONCE",
    "_aliases_first_input",
    "_ban_reason",
    "_fill_missing_values",
    "_unwrap_rng",
    "analyse_joint",
    "apply_plan",
    "block_of",
    "checkpoint",
    "checkpoint_reports",
    "clear_reports",
    "copy_graph_module",
    "is_alias",
    "is_matmul_class",
    "measure_partition",
    "no_checkpointing_saved_bytes",
    "plan_checkpointing",
    "recompute_seconds",
    "segments",
    "solve_budget",
    "solve_target",
    "storage_base",
]

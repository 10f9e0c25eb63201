"""Pipeline stage split: the ``pipeline`` config section, stage partitioning and the graph cut.

One module per job (README.md has the layout, the partition methods and the rules). Importing the package registers
the ``pipeline_parallel`` config section and the ``pipeline_split`` pass. The names other code imports are re-exported.
"""

from __future__ import annotations

from dscompile.passes.pipeline_split.config import SCHEDULES, PipelineParallelConfig
from dscompile.passes.pipeline_split.facts import GraphFacts, graph_facts, layer_of, module_path
from dscompile.passes.pipeline_split.partition import PartitionPlan, min_max_partition, plan_partition
from dscompile.passes.pipeline_split.program import (
    InputRef,
    StagedProgram,
    StageSpec,
    TensorSpec,
    attribute_graph,
    describe_plan,
    getattr_path,
    split_program,
)
from dscompile.passes.pipeline_split.split_pass import (
    ARGS_KEY,
    MODULE_KEY,
    PLAN_KEY,
    PROGRAM_KEY,
    PipelineSplitOptions,
    pipeline_split_pass,
)

__all__ = [
    "ARGS_KEY",
    "MODULE_KEY",
    "PLAN_KEY",
    "PROGRAM_KEY",
    "SCHEDULES",
    "GraphFacts",
    "InputRef",
    "PartitionPlan",
    "PipelineParallelConfig",
    "PipelineSplitOptions",
    "StageSpec",
    "StagedProgram",
    "TensorSpec",
    "attribute_graph",
    "describe_plan",
    "getattr_path",
    "graph_facts",
    "layer_of",
    "min_max_partition",
    "module_path",
    "pipeline_split_pass",
    "plan_partition",
    "split_program",
]

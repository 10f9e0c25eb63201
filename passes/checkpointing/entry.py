"""The ``checkpoint`` pass: plan on the joint graph, tag it, and install the partition function that measures."""

from __future__ import annotations

import logging

import torch
import torch.fx

from dscompile.errors import DSCompileConfigError
from dscompile.passes.checkpointing.config import CheckpointOptions, PartitionGroupMissingError
from dscompile.passes.checkpointing.partition import _make_partition_fn
from dscompile.passes.checkpointing.plan import _plan_and_tag
from dscompile.passes.checkpointing.reports import _log_once
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.checkpoint")


@register_pass("checkpoint", graphs=("joint",), options=CheckpointOptions)
def checkpoint(gm: torch.fx.GraphModule, ctx: PassContext, options: CheckpointOptions) -> torch.fx.GraphModule:
    """Decide per forward node whether backward gets it saved or recomputes it (policy none|full|selective|budget)."""
    if options is None:
        options = CheckpointOptions()
    group_size = _partition_group_size(options, ctx.world_size)
    if options.synchronize_boundary:
        _log_once("sync_boundary", "synchronize_checkpoint_boundary has no effect: compiled graphs have no per-block boundaries to synchronise")
    num_fwd_outputs = ctx.num_fwd_outputs
    if num_fwd_outputs is None:
        log.warning("%s: no forward-output count in the context; leaving the graph unchanged", ctx.graph_name)
        return gm
    plan = _plan_and_tag(gm, ctx.graph_name, ctx.example_inputs, num_fwd_outputs, options)
    if plan.cut is not None:
        ctx.analysis["checkpointing_plan"] = plan.summary()
    ctx.analysis["partition_fn"] = _make_partition_fn(ctx, plan, options, group_size, tuple(gm.graph.nodes))
    return gm


def _partition_group_size(options: CheckpointOptions, world_size: int) -> int:
    """The size of the group ``partition_activations`` shards across (0: no partitioning), or a clear refusal."""
    if not options.partition_activations:
        return 0
    size = options.partition_group_size
    if world_size == 1 or size == 1:
        _log_once("partition_single", "partition_activations: a partition group of one rank; there are no other copies of "
                  "the activations to shard across, so it has no effect")
        return 0
    if size == 0:
        raise PartitionGroupMissingError(world_size)
    if world_size % size:
        raise DSCompileConfigError("activation_checkpointing.partition_group_size",
                                   f"{size} does not divide the world size {world_size}", "use a divisor of the world size")
    return size

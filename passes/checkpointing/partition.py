"""The partition function the pass installs (``ctx.analysis["partition_fn"]``): partition the joint graph by the
plan's tags, cut again should the partitioner save more than the budget allows, then shard
(``partition_activations``) and offload (``cpu_checkpointing``) the saved activations and record the result."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from dscompile.passes.checkpointing.blocks import block_of
from dscompile.passes.checkpointing.config import CheckpointOptions
from dscompile.passes.checkpointing.joint import analyse_joint
from dscompile.passes.checkpointing.measure import _fill_missing_values, copy_graph_module, measure_partition
from dscompile.passes.checkpointing.plan import Plan, _plan_and_tag, _restore_pins, apply_plan
from dscompile.passes.checkpointing.reports import _log_once, _record
from dscompile.passes.checkpointing.solver import CutSolver, solve_target
from dscompile.pipeline import PassContext

log = logging.getLogger("dscompile.passes.checkpoint")


def _make_partition_fn(ctx: PassContext, plan: Plan, options: CheckpointOptions, group_size: int = 0,
                       planned: tuple[torch.fx.Node, ...] = ()) -> Callable[..., Any]:
    """The partition function: partition the joint graph by the plan's tags and measure the result.
    ``planned`` is the joint graph's nodes when the pass planned; a later joint pass that changed it
    (common-subexpression elimination merges a decomposed backward's recomputation into forward
    values) would leave the plan describing another graph, so the plan is made again on this one."""

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs: Any) -> Any:
        nonlocal plan
        if plan.cut is not None and tuple(joint.graph.nodes) != planned:
            log.info("%s: the joint graph changed after the checkpoint pass; planning again on the graph partitioned", ctx.graph_name)
            _restore_pins(joint)
            plan = _plan_and_tag(joint, ctx.graph_name, joint_inputs, num_fwd_outputs, options)
            plan.notes.append("planned again: a later joint pass changed the graph")
            ctx.analysis["checkpointing_plan"] = plan.summary()
        pristine = copy_graph_module(joint) if plan.target is not None else None  # untouched, should the budget need a second cut
        fw, bw, measured = _partition_and_measure(joint, joint_inputs, num_fwd_outputs, kwargs)
        if pristine is not None and measured["saved_bytes"] > plan.target:
            plan, joint, fw, bw, measured = _keep_budget(pristine, joint_inputs, num_fwd_outputs, kwargs, plan, (joint, fw, bw, measured))
            ctx.analysis["checkpointing_plan"] = plan.summary()
        report = {"graph": ctx.graph_name, **plan.summary(), **measured}
        joint_nodes = {n.name: n for n in joint.graph.nodes}
        report["saved_block"] = {name: block_of(joint_nodes[name]) if name in joint_nodes else None for name in report["saved"]}
        to_offload = report["saved"]
        if group_size > 1:
            to_offload = _partition(fw, bw, num_fwd_outputs, report, group_size, bool(getattr(ctx.config, "debug", False)))
        if options.cpu_offload:
            report["offloaded"] = _offload(fw, bw, num_fwd_outputs, to_offload)
        _record(ctx, report, options)
        return fw, bw

    return partition


def _partition_and_measure(joint: torch.fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
                           kwargs: dict[str, Any]) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, dict[str, Any]]:
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    for module in (fw, bw):
        _fill_missing_values(module)
    return fw, bw, measure_partition(fw, bw, num_fwd_outputs)


def _keep_budget(pristine: torch.fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int, kwargs: dict[str, Any], plan: Plan,
                 first: tuple[Any, ...], attempts: int = 2) -> tuple[Any, ...]:
    """The partitioner saved more than the plan predicted (it may keep a value the cut model did not
    expect): plan again for a target lowered by the overshoot, on a fresh copy of the joint graph,
    until the measured bytes meet the budget. Returns (plan, joint, fw, bw, measured) of the best try."""
    assert plan.target is not None
    best = (plan, *first)
    target = plan.target
    for attempt in range(attempts):
        over = best[4]["saved_bytes"] - plan.target
        if over <= 0:
            break
        target -= over
        joint = copy_graph_module(pristine)
        _restore_pins(joint)
        info = analyse_joint(joint, num_fwd_outputs)
        solver = CutSolver(info)
        baseline = solver.solve(math.inf)
        retry = Plan(plan.policy, plan.budget, solve_target(solver, max(target, 0.0), baseline), baseline,
                     [*plan.notes, f"second cut {attempt + 1}: the partitioner saved {over:.0f} bytes over the target"],
                     forward=info.forward, reference=plan.reference, target=plan.target)
        apply_plan(joint, retry)
        fw, bw, measured = _partition_and_measure(joint, joint_inputs, num_fwd_outputs, kwargs)
        log.info("checkpoint: the partition saved %.0f bytes over the budget's %.0f; cut again for %.0f: %d saved",
                 over, plan.target, target, measured["saved_bytes"])
        if measured["saved_bytes"] < best[4]["saved_bytes"]:
            best = (retry, joint, fw, bw, measured)
    if best[4]["saved_bytes"] > plan.target:
        log.warning("checkpoint: memory_budget %.2f not met: the partition saves %d bytes, the budget allows %.0f",
                    plan.budget, best[4]["saved_bytes"], plan.target)
    return best


def _partition(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int, report: dict[str, Any], group_size: int,
               verify: bool = False) -> list[str]:
    """Shard the saved activations across the partition group; the report's saved bytes become this
    rank's (``saved_bytes_unpartitioned`` keeps the whole). ``verify`` (config ``debug``) checks in
    forward that the group's copies agree. Returns the names now saved."""
    from dscompile.runtime.activation_partition import partition_group, partition_saved_activations

    result = partition_saved_activations(fw, bw, num_fwd_outputs, report["saved"], partition_group(group_size), verify=verify)
    report["partition"] = result.summary()
    report["saved_bytes_unpartitioned"] = report["saved_bytes"]
    report["saved_bytes"] -= result.full_bytes - result.shard_bytes
    report["activation_bytes"] -= result.full_bytes - result.shard_bytes
    if result.kept_whole:
        log.info("partition_activations kept %d saved values whole: %s", len(result.kept_whole), result.kept_whole)
    return [result.sharded.get(name, name) for name in report["saved"]]


def _offload(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int, names: list[str]) -> list[str]:
    from dscompile.runtime.activation_offload import offload_saved_activations

    moved = offload_saved_activations(fw, bw, num_fwd_outputs, names)
    if not moved and names:
        _log_once("cpu_offload_cpu", "cpu_checkpointing: saved activations already live in host memory (CPU run); nothing to move")
    return moved

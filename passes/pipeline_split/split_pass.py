"""The ``pipeline_split`` pass (pre-autograd): the one place the split is decided and, with ``cut``, made.

Without ``cut`` it annotates each node's stage; with it, it also cuts the stages into ``ctx.analysis`` for the pipeline
engine, from the module and arguments the frontend's capture left there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.fx

from dscompile.errors import DSCompileConfigError, DSCompilePipelineError
from dscompile.graph import ds_meta
from dscompile.passes.pipeline_split.facts import GraphFacts, graph_facts
from dscompile.passes.pipeline_split.partition import PartitionPlan, plan_partition
from dscompile.passes.pipeline_split.program import attribute_graph, describe_plan, split_program
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.pipeline_split")


MODULE_KEY = "captured_module"  # ctx.analysis: the nn.Module the graph was captured from
ARGS_KEY = "captured_args"  # ctx.analysis: the arguments it was called with (the example batch)
PROGRAM_KEY = "pipeline_program"  # ctx.analysis: the StagedProgram the pass cut
PLAN_KEY = "pipeline_plan"  # ctx.analysis: the PartitionPlan


@dataclass
class PipelineSplitOptions:
    stages: int = field(default=2, metadata={"help": "how many pieces: ranks per pipeline times chunks per rank"})
    method: str = field(default="cost", metadata={"help": "cost | parameters | uniform | type:REGEX (pipeline.partition_method)"})
    split_points: tuple[str, ...] = field(default=(), metadata={"help": "cut in front of these modules, in forward order"})
    memory_weight: float = field(default=0.1, metadata={"help": "pipeline.cost_memory_weight"})
    flops_per_byte: float = field(default=1.0, metadata={"help": "pipeline.cost_flops_per_byte"})
    strip: str = field(default="", metadata={"help": "module-path prefix split points and layers leave out (the engine's loss wrapper)"})
    cut: bool = field(default=False, metadata={"help": "also cut the stage graphs into ctx.analysis['pipeline_program'] (the pipeline engine)"})


@register_pass("pipeline_split", graphs=["pre_autograd"], options=PipelineSplitOptions)
def pipeline_split_pass(gm: torch.fx.GraphModule, ctx: PassContext, options: PipelineSplitOptions) -> None:
    """Annotate each node with its pipeline stage (``meta['dscompile']['stage']``); with ``cut``, cut the stage
    graphs into ``ctx.analysis['pipeline_program']`` for the pipeline engine (``gm`` itself is not rewritten)."""
    if options.cut:
        _cut(gm, ctx, options)
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_nodes = {placeholders[i] for i in ctx.param_names if i < len(placeholders)}
    facts = graph_facts(gm, param_nodes, options.strip)
    if len(facts.nodes) < options.stages:
        log.info("graph %s has %d nodes, fewer than %d stages: left unannotated", ctx.graph_name, len(facts.nodes), options.stages)
        return None
    try:
        plan = _plan(facts, options)
    except (ValueError, DSCompileConfigError) as exc:
        log.info("graph %s not annotated: %s", ctx.graph_name, exc)
        return None
    for i, node in enumerate(facts.nodes):
        ds_meta(node)["stage"] = plan.stage_of(i)
    ctx.analysis[PLAN_KEY] = plan
    log.info("%s", describe_plan(None, plan, facts))
    return None


def _plan(facts: GraphFacts, options: PipelineSplitOptions) -> PartitionPlan:
    return plan_partition(
        facts,
        options.stages,
        options.method,
        split_points=options.split_points,
        memory_weight=options.memory_weight,
        flops_per_byte=options.flops_per_byte,
        strip=options.strip,
    )


def _cut(gm: torch.fx.GraphModule, ctx: PassContext, options: PipelineSplitOptions) -> None:
    """Plan on a copy of ``gm`` whose parameters are ``get_attr`` of the captured module, cut that copy into the
    StagedProgram, and annotate ``gm``'s nodes with the same stages. Errors are the user's (a split point that
    matches nothing, too few layers): raised, not logged, since the engine cannot run without its stages."""
    root = ctx.analysis.get(MODULE_KEY)
    args = ctx.analysis.get(ARGS_KEY)
    if root is None or args is None:
        raise DSCompilePipelineError(
            "pipeline_split(cut=true) cuts the stage graphs for the pipeline engine and needs the captured module and its "
            f"arguments in ctx.analysis[{MODULE_KEY!r}] and [{ARGS_KEY!r}] (dscompile.frontend.capture puts them there); "
            "inside torch.compile use pipeline_split without cut, which annotates the stages"
        )
    target, param_nodes = attribute_graph(gm, root, ctx.example_inputs, args)
    facts = graph_facts(target, param_nodes, options.strip)
    plan = _plan(facts, options)
    by_name = {node.name: node for node in gm.graph.nodes}
    for i, node in enumerate(facts.nodes):
        if node.name in by_name:
            ds_meta(by_name[node.name])["stage"] = plan.stage_of(i)
    program = split_program(target, root, facts, plan, param_nodes, args)
    program.facts = facts
    ctx.analysis[PLAN_KEY] = plan
    ctx.analysis[PROGRAM_KEY] = program
    log.info("%s", program.describe())

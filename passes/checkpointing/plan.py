"""A policy's plan (which forward values are saved, which recomputed) and the tags that make the partitioner
follow it: ``node.meta["recompute"]`` (``MUST_SAVE`` / ``MUST_RECOMPUTE``) on every forward node."""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from dscompile.errors import DSCompileConfigError
from dscompile.graph import ds_meta, node_value
from dscompile.passes.checkpointing.blocks import segments
from dscompile.passes.checkpointing.config import CheckpointOptions
from dscompile.passes.checkpointing.joint import analyse_joint
from dscompile.passes.checkpointing.measure import no_checkpointing_saved_bytes
from dscompile.passes.checkpointing.solver import Cut, CutSolver, solve_budget

log = logging.getLogger("dscompile.passes.checkpoint")
_OPS = None


def _op_types() -> Any:
    """torch's partitioner op lists (which ops it counts as compute-intensive: policy ``selective`` never recomputes
    those), loaded at first use."""
    global _OPS
    if _OPS is None:
        from torch._functorch.partitioners import get_default_op_list

        _OPS = get_default_op_list()
    return _OPS


@dataclass
class Plan:
    """One graph's decision: the cut of its policy (None: no decisions) beside the no-recompute baseline cut, and
    what ``summary()`` reports of it (``ctx.analysis["checkpointing_plan"]``, the measured report's first half)."""

    policy: str
    budget: float | None
    cut: Cut | None
    baseline: Cut | None
    notes: list[str] = field(default_factory=list)
    forward: list[torch.fx.Node] = field(default_factory=list, repr=False)
    boundary: list[str] | None = None  # policy full: the segment inputs, the only values it may save
    reference: float | None = None  # policy budget: the no-checkpointing saved bytes (None: unknown)
    target: float | None = None  # policy budget: the saved bytes it promises at most

    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = {"policy": self.policy, "memory_budget": self.budget, "notes": self.notes}
        if self.baseline is not None:
            data["baseline_saved_bytes"] = int(self.baseline.saved_bytes)
        if self.reference is not None:
            data["no_checkpointing_saved_bytes"] = int(self.reference)
        if self.target is not None:
            data["target_saved_bytes"] = int(self.target)
        if self.cut is not None:
            data["predicted_saved_bytes"] = int(self.cut.saved_bytes)
            data["predicted_recompute_flops"] = int(self.cut.recompute_flops)
            data["predicted_recompute_seconds"] = self.cut.recompute_seconds
            data["predicted_saved"] = sorted(n.name for n in self.cut.saved if n.op != "placeholder")
            data["recomputed"] = sorted(n.name for n in self.cut.recomputed)
            data["rng_replays"] = self.cut.rng_replays
        if self.boundary is not None:
            data["boundary"] = self.boundary
        return data


def plan_checkpointing(gm: torch.fx.GraphModule, num_fwd_outputs: int, options: CheckpointOptions, reference: float | None = None) -> Plan:
    """The plan of ``options``'s policy; ``reference`` (policy budget): the no-checkpointing saved
    bytes the budget is a fraction of (``no_checkpointing_saved_bytes``), None: the no-recompute cut's."""
    policy = options.resolved_policy()
    if policy == "none":
        return Plan(policy, None, None, None)
    info = analyse_joint(gm, num_fwd_outputs)
    if policy == "budget":
        assert options.budget is not None
        cut, baseline = solve_budget(info, options.budget, reference)
        plan = Plan(policy, options.budget, cut, baseline, forward=info.forward)
        plan.reference = reference
        plan.target = options.budget * (baseline.saved_bytes if reference is None else reference)
        return plan
    baseline = CutSolver(info).solve(math.inf)
    if policy == "selective":
        ops = _op_types()
        expensive = [n for n in info.forward if ops.is_compute_intensive(n) or "attention" in str(n.target)]
        cut = CutSolver(info, extra_banned=expensive).solve(0.0)
        return Plan(policy, None, cut, baseline, forward=info.forward)
    # full: inside a segment only the segment's inputs may be saved.
    seg = segments(info, options.number_checkpoints)
    boundary = {n for n in info.forward if seg[n] >= 0 and any(u in seg and seg[u] != seg[n] for u in n.users)}
    outside = [n for n in info.forward if seg[n] < 0]

    def may_save(node: torch.fx.Node) -> bool:
        if seg.get(node, -1) < 0 or node in boundary:
            return True
        # getitems of an op that may not be recomputed must be saved
        return node.target is operator.getitem and node.args[0] in info.banned

    cut = CutSolver(info, may_save=may_save, extra_banned=[*outside, *boundary]).solve(0.0)
    notes = [f"{len(set(v for v in seg.values() if v >= 0))} segments"]
    plan = Plan(policy, None, cut, baseline, notes, forward=info.forward)
    plan.boundary = sorted(n.name for n in boundary)
    return plan


def apply_plan(gm: torch.fx.GraphModule, plan: Plan) -> None:
    """Tag every forward node so the partitioner reproduces the plan's cut."""
    assert plan.cut is not None
    cut = plan.cut
    for node in plan.forward:
        value = node_value(node)
        if not isinstance(value, (torch.Tensor, tuple, list)):
            continue  # symbolic sizes: the partitioner handles them
        ds_meta(node).setdefault("pin", node.meta.get("recompute"))  # an earlier pass's pin, for a second plan
        if node in cut.recomputed:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            ds_meta(node)["checkpoint"] = "recompute"
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            ds_meta(node)["checkpoint"] = "save" if node in cut.saved else "forward"


def _restore_pins(gm: torch.fx.GraphModule) -> None:
    """Undo ``apply_plan``'s tags, leaving the pins earlier passes had set."""
    for node in gm.graph.nodes:
        meta = node.meta.get("dscompile", {})
        if "pin" not in meta:
            continue
        pin = meta.pop("pin")
        meta.pop("checkpoint", None)
        if pin is None:
            node.meta.pop("recompute", None)
        else:
            node.meta["recompute"] = pin


def _plan_and_tag(gm: torch.fx.GraphModule, graph_name: str, example_inputs: Any, num_fwd_outputs: int,
                  options: CheckpointOptions) -> Plan:
    """Plan ``options``'s policy on ``gm`` and tag its forward nodes; a graph the planner cannot
    handle is left to the default partitioner, with a warning saying why."""
    try:
        reference = None
        if options.resolved_policy() == "budget":
            reference = _reference_bytes(gm, graph_name, example_inputs, num_fwd_outputs)
        plan = plan_checkpointing(gm, num_fwd_outputs, options, reference)
    except Exception as exc:  # networkx unbounded flows, odd graphs: stay correct, say why
        if isinstance(exc, DSCompileConfigError):
            raise
        log.warning("%s: cannot plan checkpointing (%s: %s); leaving the graph to the default partitioner",
                    graph_name, type(exc).__name__, exc)
        plan = Plan("none", None, None, None, [f"planning failed: {exc}"])
    if plan.cut is not None:
        apply_plan(gm, plan)
    return plan


def _reference_bytes(gm: torch.fx.GraphModule, graph_name: str, example_inputs: Any, num_fwd_outputs: int) -> float | None:
    """The no-checkpointing saved bytes a budget is a fraction of; None (with a warning) when the
    default partition of this graph cannot be measured; the budget then counts from the
    no-recompute cut, which saves more, and the warning says the promise is weaker."""
    try:
        return float(no_checkpointing_saved_bytes(gm, example_inputs, num_fwd_outputs))
    except Exception as exc:  # an odd graph the default partitioner rejects: say so, stay safe
        log.warning("%s: cannot measure the no-checkpointing partition (%s: %s); memory_budget counts from the "
                    "no-recompute saved bytes instead", graph_name, type(exc).__name__, exc)
        return None

"""The joint graph as the solver sees it: forward/backward split, bytes per storage, recompute time, bans.

Bytes are counted per storage: an alias (a view by the op's schema, ``detach``, ``_unsafe_view``, an item of
``split``) holds its base's whole storage, two saved aliases of one tensor hold it once, and an alias of a graph
input (a transposed parameter) holds nothing new. Time is ``dscompile.cost``'s roofline (``node_seconds``);
aliases are free.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from dscompile.cost import Roofline, _shape_hints, evaluate, nbytes, node_cost, node_seconds, roofline_for
from dscompile.graph import ds_meta, is_collective, node_value, tensor_values


def recompute_seconds(node: torch.fx.Node, hints: dict[Any, int], roofline: Roofline) -> float:
    """Estimated time to recompute ``node`` (the cost model's ``node_seconds``); views and other aliases are free."""
    if node.op != "call_function" or is_alias(node):
        return 0.0
    return node_seconds(node, hints, roofline)


def _graph_device(nodes: Iterable[torch.fx.Node]) -> torch.device:
    """The device of the first real (not meta) tensor among ``nodes``' values, whose roofline prices them; CPU if none."""
    for node in nodes:
        for t in tensor_values(node_value(node)):
            if t.device.type != "meta":
                return t.device
    return torch.device("cpu")


def is_alias(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value shares its first argument's storage: a view by the op's schema
    (``view``, ``transpose``, ``detach``, ``split``, ...), ``_unsafe_view`` (it declares no alias but
    returns one), or an item of a view op's tuple. torch's partitioner lists fewer views
    (no transpose, no detach), which would count a transposed parameter as an activation."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if node.target is operator.getitem:
        return is_alias(node.args[0])
    return bool(getattr(node.target, "is_view", False)) or node.target is torch.ops.aten._unsafe_view.default


def storage_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node that allocated the storage ``node``'s value lives in (itself unless it is an alias).

    Saving any alias keeps that whole storage alive, so bytes are counted per base: a placeholder
    base costs nothing (the caller holds graph inputs and parameters anyway), and two saved views
    of one tensor cost it once."""
    while is_alias(node):
        node = node.args[0]  # an item of split(x) walks to split, then to x
    return node


def _is_tangent(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and ("tangents" in str(node.target) or "bwd_seed" in str(node.target) or "bwd_base_offset" in str(node.target))


def _must_run_in_backward(node: torch.fx.Node) -> bool:
    """As AOTAutograd's partitioner decides: a node tagged for backward runs there only when it must
    (a mutation, or an explicit tag). A tangent-free node traced in backward (the rsqrt / N of a
    decomposed layer-norm backward) is the cut's choice: saved from forward or computed in backward,
    so this pass prices and tags it like every forward value, or the partitioner would choose alone."""
    tag = node.meta.get("partitioner_tag")
    if tag == "must_be_in_backward":
        return True
    return tag == "is_backward" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _is_random(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


@dataclass
class JointInfo:
    """Forward/backward split of a joint graph with sizes and FLOPs at the shape hints."""

    forward: list[torch.fx.Node]  # call_function nodes computable from primals alone
    backward: set[torch.fx.Node]
    primals: list[torch.fx.Node]
    required_fw: set[torch.fx.Node]  # needed for the user outputs (recomputing them costs)
    needed_by_bw: set[torch.fx.Node]  # forward nodes some backward node depends on
    size: dict[torch.fx.Node, float]  # bytes if saved (math.inf: cannot be saved)
    flops: dict[torch.fx.Node, int]
    seconds: dict[torch.fx.Node, float]  # roofline time of recomputing the node once
    banned: dict[torch.fx.Node, str]  # never recomputed, with the reason
    rng_state_bytes: int
    # pinned by an earlier pass or the user (``meta["recompute"] = MUST_RECOMPUTE``), e.g. ZeRO-3's
    # parameter gathers: never saved. MUST_SAVE pins land in ``banned``.
    must_recompute: set[torch.fx.Node] = field(default_factory=set)


def analyse_joint(gm: torch.fx.GraphModule, num_fwd_outputs: int) -> JointInfo:
    """Split ``gm`` into forward and backward and price every forward value: bytes if saved, FLOPs and seconds if
    recomputed, why it may not be recomputed, and which values earlier passes pinned."""
    hints = _shape_hints(gm)
    nodes = list(gm.graph.nodes)
    output = next(n for n in reversed(nodes) if n.op == "output")
    backward: set[torch.fx.Node] = set()
    for node in nodes:
        if node.op == "output":
            continue
        if _is_tangent(node) or _must_run_in_backward(node) or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    primals = [n for n in nodes if n.op == "placeholder" and n not in backward]
    forward = [n for n in nodes if n.op == "call_function" and n not in backward]
    fw_outputs = [a for a in output.args[0][:num_fwd_outputs] if isinstance(a, torch.fx.Node)]
    required_fw = _ancestors(fw_outputs, stop=backward)
    needed_by_bw: set[torch.fx.Node] = set()
    for node in backward:
        needed_by_bw |= _ancestors([a for a in node.all_input_nodes if a not in backward], stop=backward)
    roofline = roofline_for(_graph_device(forward))
    size: dict[torch.fx.Node, float] = {}
    flops: dict[torch.fx.Node, int] = {}
    seconds: dict[torch.fx.Node, float] = {}
    banned: dict[torch.fx.Node, str] = {}
    must_recompute: set[torch.fx.Node] = set()
    for node in primals + forward:
        value = node_value(node)
        if node.op == "placeholder":
            size[node] = 0.0  # inputs and parameters are alive anyway
            flops[node] = 0
            seconds[node] = 0.0
            continue
        base = storage_base(node)
        if isinstance(value, torch.Tensor):
            # saving an alias keeps its base's whole storage alive; an alias of an input costs nothing
            held = node_value(base) if base is not node else value
            size[node] = 0.0 if base.op == "placeholder" else float(evaluate(nbytes(held), hints)) if isinstance(held, torch.Tensor) else math.inf
        elif isinstance(value, (torch.SymInt, int, float, bool)):
            size[node] = 0.0
        else:
            size[node] = math.inf  # tuples: their getitems are what gets saved
        flops[node] = 0 if is_alias(node) else evaluate(node_cost(node).flops, hints)
        seconds[node] = recompute_seconds(node, hints, roofline)
        reason = _ban_reason(node)
        pinned = node.meta.get("recompute")
        if reason:
            banned[node] = reason
        elif pinned == CheckpointPolicy.MUST_SAVE:
            banned[node] = "pinned to MUST_SAVE before this pass"
        elif pinned == CheckpointPolicy.MUST_RECOMPUTE:
            must_recompute.add(node)
        elif pinned is None and _aliases_first_input(node) and node.args[0] in must_recompute:
            # saving a view (or one output of a pinned tuple op) would keep the pinned value alive: a gathered ZeRO-3 parameter
            must_recompute.add(node)
    return JointInfo(forward, backward, primals, required_fw, needed_by_bw, size, flops, seconds, banned, _rng_state_bytes(forward),
                     must_recompute)


def _aliases_first_input(node: torch.fx.Node) -> bool:
    """A view of its first input (by the op's schema), or one output of a tuple-valued node."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def _ancestors(start: Iterable[torch.fx.Node], stop: set[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [n for n in start if n not in stop]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(a for a in node.all_input_nodes if a not in stop and a not in seen)
    return seen


def _ban_reason(node: torch.fx.Node) -> str | None:
    target = node.target
    if is_collective(node):
        return None if ds_meta(node).get("recomputable") else "collective not marked recomputable"
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return "mutates its input"
    if node.is_impure() and not _is_random(node):
        return "impure"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher-order op"
    return None


def _rng_state_bytes(forward: list[torch.fx.Node]) -> int:
    """What the partitioner saves per replayed random op: the generator state of its device."""
    for node in forward:
        if _is_random(node):
            for t in tensor_values(node_value(node)):
                return 16 if t.device.type == "cuda" else torch.get_rng_state().numel()
    return 0

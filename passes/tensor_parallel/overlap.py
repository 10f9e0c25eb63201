"""Overlap tensor-parallel all-reduces with the computation that does not need them (``tp_overlap_comm``).

Megatron's *f* (``tp_copy``) all-reduces the gradient of a block's input in backward; as traced, that
all-reduce starts after the column-parallel linears' backward is complete (their weight gradients
included) and is waited for at once, so the rank idles while it travels. DeepSpeed's AutoTP
``tp_overlap_comm`` runs the weight-gradient matmuls while that all-reduce is in flight. Here it is a
scheduling pass over the compiled (split) graphs, forward and backward, for every functional
``all_reduce`` + ``wait_tensor`` pair in them (under ``tensor_parallel`` those are TP's: ``tp_copy``'s
and ``tp_sum_replicas``' in backward, ``tp_reduce``'s and the vocabulary-parallel loss's in forward):

- *issue early*: between the previous all-reduce (and what this pass put after it) and this one, every
  node the all-reduce does not depend on (the weight-gradient matmuls, in backward; in forward whatever
  independent work there is, e.g. the rotary tables or masks of later layers) moves after it, keeping
  its order; the nodes it depends on (the input-gradient matmuls and their sum) keep theirs, so the
  all-reduce starts as soon as its input exists;
- *wait late*: its ``wait_tensor`` (and views of the result) sink to their first real consumer
  (``zero_schedule.sink_to_first_use``, as ``zero_overlap`` does for ZeRO's reduce-scatters).

Nothing crosses a node with side effects (a mutation, a random draw, another collective the all-reduce does
not need, a placeholder or the output), so the order of collectives, writes and random numbers is what it
was, and the maths is unchanged: only the order of independent nodes moves. The window ends at the previous all-reduce's
group, so a block's weight gradients are computed under its own all-reduce, not pushed further.
With ``tp_overlap_comm: false`` (DeepSpeed's default) the pass is not in the pipeline.

Inductor (the default lowering) would undo the order in two ways, both checked on its generated code
(``tests/test_tensor_parallel_overlap.py``): its reordering for peak memory puts the weight-gradient matmuls
back before the all-reduce, so the pass asks the lowering to turn that off for the graphs it scheduled
(``ctx.analysis["inductor_config"]``, read by ``backends/inductor.py``); and it fuses a pointwise or reduction
node left before a wait with a like one after it, placing the fused kernel (and so the wait) at the first, so
the moved matmuls go first among the moved nodes. Inductor's own ``reorder_for_compute_comm_overlap`` (which
schedules by its cost estimates) is left off: the order this pass chose is kept instead.

The split graph reaches the pipeline under the config the engine compiles it with, less the tensor-parallel
split (``split_graph_sections``: the section stays at ``autotp_size`` 1 when ``tp_overlap_comm`` is on), so
the pass also runs on each pipeline stage's graph under TP × pipeline, and after the ZeRO passes under
TP × ZeRO-2/3 (their collectives are barriers it never moves).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from dscompile.passes.zero_schedule import GraphOrder, move_after, sink_to_first_use, sole_user
from dscompile.pipeline import PassContext, invocation, register_config_rule, register_pass

log = logging.getLogger("dscompile.passes.tp_overlap")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
# ops that only reshape an all-reduced value: they follow its wait down to the first real consumer
_CHEAP = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor, aten.select.int, c10d.wait_tensor.default}


_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default}
# what the Inductor lowering is told for a graph this pass scheduled (backends/inductor.py reads it)
KEEP_ORDER = {"reorder_for_peak_memory": False}


@dataclass
class TensorParallelOverlapOptions:
    overlap_comm: bool = True


def is_all_reduce_start(node: torch.fx.Node) -> bool:
    """A functional all-reduce whose only user is its wait (what ``sum_in_group`` traces to)."""
    if node.op != "call_function" or node.target is not c10d.all_reduce.default or len(node.users) != 1:
        return False
    return next(iter(node.users)).target is c10d.wait_tensor.default


def _is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d_functional", "c10d")


def _mutates(node: torch.fx.Node) -> bool:
    """A node nothing may cross: a write, a side effect, a draw from the random generator (moving it would hand
    another op its numbers: dropout masks would change), or not a call at all (placeholders, attributes)."""
    if node.op != "call_function" or node.target in torch.fx.node._side_effectful_functions:
        return True
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and schema.is_mutable) or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def issue_early(start: torch.fx.Node, floor: torch.fx.Node | None) -> list[torch.fx.Node]:
    """Move the nodes between ``floor`` (exclusive) and ``start`` that ``start`` does not depend on to right
    after it, keeping their order. The walk up from ``start`` stops at ``floor``, at a node with side effects,
    and at another collective ``start`` does not need. Returns the moved nodes, in order."""
    needed = {start}
    independent: list[torch.fx.Node] = []
    node = start.prev
    while node is not floor and node.op != "root":
        is_needed = any(user in needed for user in node.users)
        if _mutates(node) and not _is_collective(node) or (_is_collective(node) and not is_needed):
            break  # a write, a placeholder, or another collective this one does not wait for: nothing crosses it
        if is_needed:
            needed.add(node)
        else:
            independent.append(node)
        node = node.prev
    independent.reverse()
    independent = _matmuls_first(independent)
    move_after(start, independent)
    return independent


def _matmuls_first(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The matmuls among ``nodes`` and what they need of them first, then the rest, each part in its order.
    Inductor fuses a pointwise or reduction node left before a wait with a like one after it and places the
    fused kernel at the first, pulling the wait up with it; the matmuls (never fused) then still run before."""
    heavy: set[torch.fx.Node] = set()
    members = set(nodes)
    stack = [n for n in nodes if n.target in _MATMULS]
    while stack:
        node = stack.pop()
        if node in heavy:
            continue
        heavy.add(node)
        stack.extend(arg for arg in node.all_input_nodes if arg in members)
    return [n for n in nodes if n in heavy] + [n for n in nodes if n not in heavy]


@register_pass("tp_overlap", graphs=("forward", "backward"), options=TensorParallelOverlapOptions)
def tp_overlap(gm: torch.fx.GraphModule, ctx: PassContext, options: TensorParallelOverlapOptions) -> torch.fx.GraphModule:
    """Start each all-reduce as soon as its input exists (independent nodes moved after it) and sink its
    wait to the first consumer: the weight-gradient matmuls run while the input gradient travels."""
    if not options.overlap_comm:
        return gm
    starts = [n for n in gm.graph.nodes if is_all_reduce_start(n)]
    floor: torch.fx.Node | None = None
    hoisted = 0
    for start in starts:  # in graph order: each window ends where the previous one's moved nodes end
        moved = issue_early(start, floor)
        hoisted += len(moved)
        floor = moved[-1] if moved else start
    order = GraphOrder(gm.graph)  # one for all the sinks: kept correct by each move
    sunk = sum(sink_to_first_use(sole_user(start), _CHEAP, order) for start in starts)
    gm.graph.lint()
    if starts:  # Inductor's reordering for peak memory would move the independent nodes back before the all-reduce
        ctx.analysis.setdefault("inductor_config", {}).setdefault(ctx.graph_kind, {}).update(KEEP_ORDER)
    log.debug(
        "%s: %d all-reduces, %d independent nodes moved after their start, %d nodes sunk to their first consumer", ctx.graph_name, len(starts), hoisted, sunk
    )
    return gm


def tp_overlap_comm(config: Any) -> bool:
    """Whether the config asks for ``tensor_parallel.tp_overlap_comm`` (kept in the split graph's config by the engine)."""
    section = getattr(config, "sections", {}).get("tensor_parallel")
    return bool(getattr(section, "tp_overlap_comm", False))


@register_config_rule(82, "tp_overlap")  # after the clean-up (its dce would not undo an order, but cse runs first)
def _tp_overlap_rule(config: Any) -> list[Any]:
    return [invocation("tp_overlap")] if tp_overlap_comm(config) else []

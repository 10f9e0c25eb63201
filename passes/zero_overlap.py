"""Overlap ZeRO gradient reduce-scatters with the rest of backward (``overlap_comm``), within a memory bound.

Insertion (and bucketing) wait for each reduce-scatter right after starting it, which
serialises communication and compute. With ``overlap_comm`` this pass sinks each wait, and the
cheap ops that only reshape its result (division by the world size, bucket slices), towards
their first real consumer, so backward keeps computing the next gradients while the previous
ones travel. With ``overlap_comm=false`` it leaves the graph as it is (DeepSpeed's stage-1/2 default).

A reduce-scatter in flight holds its whole input (the full, unsharded gradient bucket) until its
wait, so sinking every wait to its consumer, usually the graph's output, would keep every bucket
alive to the end of backward. The bound is DeepSpeed's ``reduce_bucket_size`` role (its
``overlap_comm`` reduces one bucket while the next fills): at most ``reduce_bucket_size``
elements of reduce-scatter input are outstanding at any point of the schedule. Before a
reduce-scatter would exceed that, the oldest outstanding ones are waited for, right before it
starts; a single collective larger than the bound is only ever in flight alone.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch
import torch.fx

from dscompile.graph import ds_meta
from dscompile.passes.zero import is_zero_start
from dscompile.passes.zero_schedule import GraphOrder, positions, sink_to_first_use, sole_user
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.zero_overlap")

aten = torch.ops.aten
_CHEAP = {aten.div.Tensor, aten.slice.Tensor, aten.view.default, aten.reshape.default, torch.ops._c10d_functional.wait_tensor.default}


# Ops that only lay a gradient out for its reduce-scatter; the computations that produce gradients are not moved.
_PREPARE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.constant_pad_nd.default, aten.cat.default,
            aten._to_copy.default, aten.clone.default, aten.slice.Tensor, torch.ops.prims.convert_element_type.default}


@dataclass
class ZeroOverlapOptions:
    overlap_comm: bool = True
    reduce_bucket_size: int = 500_000_000  # elements of reduce-scatter input allowed in flight at once


@register_pass("zero_overlap", graphs=("forward", "backward"), options=ZeroOverlapOptions, requires=("zero",))
def zero_overlap(gm: torch.fx.GraphModule, ctx: PassContext, options: ZeroOverlapOptions) -> torch.fx.GraphModule:
    """Sink reduce-scatter waits (and their reshapes) towards their first consumer, keeping at most
    ``reduce_bucket_size`` elements in flight."""
    if not options.overlap_comm:
        return gm
    if options.reduce_bucket_size <= 0:
        raise ValueError(f"zero_overlap: reduce_bucket_size must be positive, got {options.reduce_bucket_size}")
    graph = gm.graph
    starts = [n for n in graph.nodes if is_zero_start(n, "reduce_scatter")]
    graph_order = GraphOrder(graph)  # kept correct by every move below (positions per move were quadratic)
    hoisted = sum(_issue_early(start, graph_order) for start in starts)
    starts.sort(key=graph_order.__getitem__)  # the schedule order after hoisting
    moved = sum(sink_to_first_use(sole_user(start), _CHEAP, graph_order) for start in starts)
    deadlines = wait_deadlines(starts, options.reduce_bucket_size)
    order = positions(graph)
    held_back = 0
    for start, deadline in deadlines.items():
        wait = sole_user(start)
        if order[wait] > order[deadline]:
            deadline.prepend(wait)
            held_back += 1
    for start in starts:
        ds_meta(start)["zero"]["wait_before"] = deadlines[start].name if start in deadlines else None
    log.debug("%s: %d reduce-scatters issued earlier, %d nodes sunk past backward compute, %d waits held before a later "
              "reduce-scatter (bound %d elements)", ctx.graph_name, hoisted, moved, held_back, options.reduce_bucket_size)
    return gm


def wait_deadlines(starts: list[torch.fx.Node], limit: int) -> dict[torch.fx.Node, torch.fx.Node]:
    """For each reduce-scatter that must be finished before a later one may start, that later one.

    Walks the starts in schedule order with a first-in first-out window of outstanding ones: before
    a start whose elements would take the window past ``limit``, the oldest are retired (their
    waits must run before it). Reduce-scatters never retired are free to wait at their consumer."""
    deadlines: dict[torch.fx.Node, torch.fx.Node] = {}
    window: collections.deque[tuple[torch.fx.Node, int]] = collections.deque()
    outstanding = 0
    for start in starts:
        elements = int(ds_meta(start)["zero"]["elements"])
        while window and outstanding + elements > limit:
            oldest, size = window.popleft()
            deadlines[oldest] = start
            outstanding -= size
        window.append((start, elements))
        outstanding += elements
    return deadlines


def _issue_early(start: torch.fx.Node, order: GraphOrder) -> bool:
    """Move a reduce-scatter, with the nodes that only prepare its input (flattening, padding, the
    bucket's concatenation, a cast to the communication dtype), to right after the last value it
    needs: as soon as its gradients exist, not where tracing happened to put it (often the end of
    backward). Returns whether it moved."""
    chain: set[torch.fx.Node] = set()
    stack = list(start.all_input_nodes)
    while stack:
        node = stack.pop()
        if node in chain or node.op != "call_function" or node.target not in _PREPARE:
            continue
        if not all(user in chain or user is start for user in node.users):
            continue
        chain.add(node)
        stack.extend(node.all_input_nodes)
    needed = {arg for node in (*chain, start) for arg in node.all_input_nodes if arg not in chain}
    if not needed:
        return False
    anchor = max(needed, key=order.__getitem__)
    prepared = sorted(chain, key=order.__getitem__)
    if _within(anchor, start, len(prepared) + 1):
        return False  # already there
    order.move_after(anchor, [*prepared, start])
    return True


def _within(anchor: torch.fx.Node, node: torch.fx.Node, steps: int) -> bool:
    """Whether ``node`` is one of the ``steps`` nodes right after ``anchor``."""
    cursor = anchor
    for _ in range(steps):
        cursor = cursor.next
        if cursor is node:
            return True
    return False


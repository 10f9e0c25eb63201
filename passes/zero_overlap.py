"""Overlap ZeRO gradient reduce-scatters with the rest of backward (``overlap_comm``).

Insertion (and bucketing) wait for each reduce-scatter right after starting it, which
serialises communication and compute. With ``overlap_comm`` this pass sinks each wait, and the
cheap ops that only reshape its result (division by the world size, bucket slices), to just
before their first real consumer, usually the graph output, so backward keeps computing the
next gradients while the previous ones travel. With ``overlap_comm=false`` it leaves the graph
as it is (DeepSpeed's stage-1/2 default).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx

from dscompile.passes.zero import is_zero_start
from dscompile.passes.zero_schedule import positions, sole_user
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.zero_overlap")

aten = torch.ops.aten
_CHEAP = {aten.div.Tensor, aten.slice.Tensor, aten.view.default, aten.reshape.default, torch.ops._c10d_functional.wait_tensor.default}


@dataclass
class ZeroOverlapOptions:
    overlap_comm: bool = True


@register_pass("zero_overlap", graphs=("forward", "backward"), options=ZeroOverlapOptions, requires=("zero",))
def zero_overlap(gm: torch.fx.GraphModule, ctx: PassContext, options: ZeroOverlapOptions) -> torch.fx.GraphModule:
    """Sink reduce-scatter waits (and their reshapes) to their first consumer."""
    if not options.overlap_comm:
        return gm
    graph = gm.graph
    moved = 0
    for start in [n for n in graph.nodes if is_zero_start(n, "reduce_scatter")]:
        chain = _cheap_descendants(sole_user(start))
        order = positions(graph)
        for node in sorted(chain, key=order.__getitem__, reverse=True):
            order = positions(graph)
            first = min(node.users, key=order.__getitem__, default=None)
            if first is not None and order[first] > order[node] + 1:
                first.prepend(node)
                moved += 1
    log.debug("%s: %d nodes sunk past backward compute", ctx.graph_name, moved)
    return gm


def _cheap_descendants(wait: torch.fx.Node) -> list[torch.fx.Node]:
    found = [wait]
    stack = list(wait.users)
    while stack:
        node = stack.pop()
        if node in found or node.op != "call_function" or node.target not in _CHEAP:
            continue
        found.append(node)
        stack.extend(node.users)
    return found

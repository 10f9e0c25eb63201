"""Issue ZeRO-3 all-gathers ahead of their use (``stage3_prefetch_bucket_size``, ``stage3_max_live_parameters``).

After insertion each gather starts right before its first use, so compute waits for every
gather. This pass hoists each gather's start (and the concatenation feeding a bucket) to just
after the wait of an earlier gather: gather ``i`` may start once gather ``j-1`` has been
consumed, for the smallest ``j`` whose window ``j..i`` stays within the prefetch budget and the
live-parameter limit (both in elements). Waits stay where the values are needed, so the
communication of the next parameters overlaps the compute of the current ones. The issue order
of the all-gathers never changes: no gather moves above an earlier one (the first stays where it is,
so the second issues right after it, not ahead of it), and every rank issues them identically.

With ``offload_param`` each gather's shard is first read from the host or NVMe (``zero_param_load``), and
this pass moves that read with its gather. Last, it pins every read where the schedule put it
(``zero_param_load_after``: after the tensor computed just before it): a read depends only on the
shard, a graph input, so Inductor's reordering for peak memory would otherwise run the reads of
whole groups of layers first (every read buffer alive at once, and the reads out of the order the
store reads ahead in).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx

from dscompile.graph import ds_meta
from dscompile.passes.zero import is_zero_start, pin_param_loads
from dscompile.passes.zero_schedule import GraphOrder, ancestors_after, sole_user
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.zero_prefetch")


@dataclass
class ZeroPrefetchOptions:
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000


@register_pass("zero_prefetch", graphs=("forward", "backward"), options=ZeroPrefetchOptions, requires=("zero",))
def zero_prefetch(gm: torch.fx.GraphModule, ctx: PassContext, options: ZeroPrefetchOptions) -> torch.fx.GraphModule:
    """Hoist ZeRO-3 all-gather starts ahead of use, within the prefetch and live-parameter budgets."""
    graph = gm.graph
    starts = [n for n in graph.nodes if is_zero_start(n, "all_gather")]
    if len(starts) >= 2:
        _hoist(graph, starts, options, ctx)
    pinned = pin_param_loads(graph)
    if pinned:
        ctx.analysis.setdefault("zero_prefetch", {}).setdefault(ctx.graph_name, {})["param_loads_pinned"] = pinned
    return gm


def _hoist(graph: torch.fx.Graph, starts: list[torch.fx.Node], options: ZeroPrefetchOptions, ctx: PassContext) -> None:
    """Move each gather's start (with what feeds it) up to where its prefetch window begins."""
    waits = [sole_user(s) for s in starts]
    sizes = [ds_meta(s)["zero"]["elements"] for s in starts]
    limit = min(options.stage3_prefetch_bucket_size, options.stage3_max_live_parameters)
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    window_start, window = 0, 0
    hoisted = 0
    plan = []
    for i, size in enumerate(sizes):
        window += size
        while window_start < i and window > limit:
            window -= sizes[window_start]
            window_start += 1
        plan.append(window_start)
    order = GraphOrder(graph)  # positions computed once, kept correct by each move (not recomputed per gather)
    for i, start in enumerate(starts):
        j = plan[i]
        if j == i:
            continue  # no room to prefetch: start where it is
        anchor = last_placeholder if j == 0 else waits[j - 1]
        # the issue order: never above the previous gather's start (which may sit after the window's start)
        anchor_point = starts[i - 1] if order[starts[i - 1]] > order[anchor] else anchor
        if order[anchor_point] >= order[start]:
            continue
        chain = ancestors_after(start, anchor_point, order.key) + [start]
        order.move_after(anchor_point, chain)
        ds_meta(start)["zero"]["prefetch_after"] = anchor_point.name
        hoisted += 1
    log.debug("%s: %d of %d all-gathers prefetched", ctx.graph_name, hoisted, len(starts))
    ctx.analysis.setdefault("zero_prefetch", {})[ctx.graph_name] = {"gathers": len(starts), "prefetched": hoisted}

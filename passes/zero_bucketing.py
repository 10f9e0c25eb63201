"""Coalesce consecutive ZeRO collectives into buckets (``allgather_bucket_size`` / ``reduce_bucket_size``).

Many small collectives cost a latency each; one collective over a flat buffer costs it once.
All-gathers: the shards of consecutive gathers are concatenated, gathered together (at the
place of the first, so the others arrive early) and each parameter's ``[N, L]`` columns are
copied out. Reduce-scatters: consecutive gradients, each laid out ``[N, L]``, are concatenated
along the columns and reduce-scattered once (at the place of the last, when all are ready);
each shard gradient is a slice of the result. Bucket limits are element counts, as in DeepSpeed;
a collective larger than the limit stays alone. The all-gathers of one ZeRO-3 leaf module (``meta["zero"]["leaf"]``,
consecutive after the ``zero`` pass) form one bucket of their own whatever the limits: the leaf moves as a unit.

A bucket costs copies: the shards are concatenated into the flat input, and each gathered
parameter is copied out of its ``[N, L]`` columns (the gradients likewise into the reduce-scatter
input). A collective alone needs none (its output is the parameter, its input the gradient). On
CPU a copy of a few MiB costs more than a collective's latency (profiled on gloo: copies took a
third of a ZeRO-3 step when every parameter went through a bucket), so there only collectives of
at most ``alone_above`` elements (default ``CPU_ALONE_ABOVE``) are bucketed; on accelerators, where
latency dominates and copies are cheap, every size is (``alone_above`` -1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx

from dscompile.graph import ds_meta, node_value
from dscompile.passes.zero import is_zero_start, new_node
from dscompile.passes.zero_schedule import sole_user, stable_toposort
from dscompile.pipeline import PassContext, register_pass
from dscompile.runtime.zero_shard import CPU_ALONE_ABOVE  # one rule for the graphs and the out-of-graph collectives

log = logging.getLogger("dscompile.passes.zero_bucketing")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class ZeroBucketingOptions:
    allgather_bucket_size: int = 500_000_000
    reduce_bucket_size: int = 500_000_000
    alone_above: int = -1  # -1: CPU_ALONE_ABOVE for CPU tensors, no limit on accelerators


def _alone(node: torch.fx.Node, alone_above: int) -> bool:
    value = node_value(node.args[0])
    limit = alone_above if alone_above >= 0 else (CPU_ALONE_ABOVE if value.device.type == "cpu" else None)
    return limit is not None and ds_meta(node)["zero"]["elements"] > limit


def _buckets(starts: list[torch.fx.Node], limit: int, alone_above: int = -1) -> list[list[torch.fx.Node]]:
    buckets: list[list[torch.fx.Node]] = []
    size = 0
    closed = False  # the last bucket holds a collective that moves alone
    for node in starts:
        info = ds_meta(node)["zero"]
        dtype = node_value(node.args[0]).dtype
        leaf = info.get("leaf")
        if leaf and buckets and ds_meta(buckets[-1][0])["zero"].get("leaf") == leaf:
            head = buckets[-1][0]
            if ds_meta(head)["zero"]["group"] == info["group"] and node_value(head.args[0]).dtype == dtype:
                buckets[-1].append(node)  # a ZeRO-3 leaf module's parameters move as one unit, whatever the limits
                size += info["elements"]
                continue
        if leaf:
            buckets.append([node])  # a leaf's unit is its own bucket: nothing else joins it
            size, closed = info["elements"], True
            continue
        if _alone(node, alone_above):
            buckets.append([node])
            closed = True
            continue
        if buckets and not closed:
            head = ds_meta(buckets[-1][0])["zero"]
            same = head["group"] == info["group"] and node_value(buckets[-1][0].args[0]).dtype == dtype
            if same and size + info["elements"] <= limit:
                buckets[-1].append(node)
                size += info["elements"]
                continue
        buckets.append([node])
        size = info["elements"]
        closed = False
    return buckets


@register_pass("zero_bucketing", graphs=("forward", "backward"), options=ZeroBucketingOptions, requires=("zero",))
def zero_bucketing(gm: torch.fx.GraphModule, ctx: PassContext, options: ZeroBucketingOptions) -> torch.fx.GraphModule:
    """Merge consecutive ZeRO all-gathers / reduce-scatters into flat-buffer buckets."""
    graph = gm.graph
    gathers = [n for n in graph.nodes if is_zero_start(n, "all_gather")]
    merged = 0
    for bucket in _buckets(gathers, options.allgather_bucket_size, options.alone_above):
        if len(bucket) > 1:
            _bucket_gathers(graph, bucket)
            merged += len(bucket) - 1
    scatters = [n for n in graph.nodes if is_zero_start(n, "reduce_scatter")]
    for bucket in _buckets(scatters, options.reduce_bucket_size, options.alone_above):
        if len(bucket) > 1:
            _bucket_reduce_scatters(graph, bucket)
            merged += len(bucket) - 1
    if merged:
        stable_toposort(graph)
        graph.eliminate_dead_code()
    log.debug("%s: %d collectives merged into buckets", ctx.graph_name, merged)
    return gm


def _bucket_gathers(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
    head = ds_meta(members[0])["zero"]
    world, group = head["world"], head["group"]
    lengths = [ds_meta(m)["zero"]["shard_numel"] for m in members]
    total = sum(lengths)
    with graph.inserting_before(members[0]):
        flat = new_node(graph, aten.cat.default, ([m.args[0] for m in members],))
        start = new_node(graph, c10d.all_gather_into_tensor.default, (flat, world, group))
        wait = new_node(graph, c10d.wait_tensor.default, (start,))
        rows = new_node(graph, aten.view.default, (wait, [world, total]))
        offset = 0
        for member, length in zip(members, lengths, strict=True):
            column = new_node(graph, aten.slice.Tensor, (rows, 1, offset, offset + length))
            dense = new_node(graph, aten.clone.default, (column,), {"memory_format": torch.contiguous_format})
            full = new_node(graph, aten.view.default, (dense, [world * length]))
            sole_user(member).replace_all_uses_with(full)
            offset += length
    _erase(graph, members)
    ds_meta(start)["zero"] = {**head, "elements": world * total, "shard_numel": total, "members": len(members)}


def _bucket_reduce_scatters(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
    head = ds_meta(members[0])["zero"]
    world, group = head["world"], head["group"]
    lengths = [ds_meta(m)["zero"]["shard_numel"] for m in members]
    with graph.inserting_before(members[-1]):
        rows = [new_node(graph, aten.view.default, (m.args[0], [world, length])) for m, length in zip(members, lengths, strict=True)]
        joined = new_node(graph, aten.cat.default, (rows, 1))
        flat = new_node(graph, aten.view.default, (joined, [-1]))
        start = new_node(graph, c10d.reduce_scatter_tensor.default, (flat, "sum", world, group))
        wait = new_node(graph, c10d.wait_tensor.default, (start,))
        offset = 0
        for member, length in zip(members, lengths, strict=True):
            piece = new_node(graph, aten.slice.Tensor, (wait, 0, offset, offset + length))
            sole_user(member).replace_all_uses_with(piece)
            offset += length
    _erase(graph, members)
    ds_meta(start)["zero"] = {**head, "elements": world * sum(lengths), "shard_numel": sum(lengths), "members": len(members)}


def _erase(graph: torch.fx.Graph, members: list[torch.fx.Node]) -> None:
    for member in members:
        graph.erase_node(sole_user(member))
        graph.erase_node(member)

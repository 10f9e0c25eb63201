"""The graph rewrite of the blocks found: column/row-parallel linears, divided shapes, Megatron's f and g.

Each block gets ``tp_copy`` before its column linears, a partial row linear + ``tp_reduce`` after, its shapes
divided by TP, a whole tensor per head read by the block cut to this rank's heads (``_narrow``), a 0/1 mask over
padding when TP does not divide its units, and the gradient sums that whole values read by sliced ops (``tp_copy``)
or replicated KV heads (``tp_sum_replicas``) need. Returns the parameter slices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from dscompile.passes.tensor_parallel.blocks import Block, Linear
from dscompile.passes.tensor_parallel.graph_facts import ancestors, attr_value
from dscompile.runtime.tensor_parallel import SliceSpec, padded_units, tp_copy, tp_reduce, tp_sum_replicas, units_of_rank

aten = torch.ops.aten


def rewrite(gm: fx.GraphModule, blocks: list[Block], group: Any, tp: int, rank: int) -> dict[str, SliceSpec]:
    """Slice the shapes, make the row linears partial sums + all-reduce, put ``tp_copy`` before each block.

    A block whose units TP does not divide runs on every rank with the largest share of units: this rank's
    own, then zero-weight padding; the row-parallel linear's input is multiplied by a 0/1 mask over the
    padding, so padded units add nothing to the output and get no gradient (their weights stay zero).

    A block with replicated KV heads (``Block.replicas`` > 1) runs each rank on its share of the query heads
    and one KV head: the KV side's sizes are one head's, the repeats ``n_rep / replicas``, and the k/v weights
    go through ``tp_sum_replicas`` (their gradient summed over the ranks holding the same head).
    """
    slices: dict[str, SliceSpec] = {}
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    trainable = _trainable_values(gm)
    for index, b in enumerate(blocks):
        padded = b.units % tp != 0 and b.replicas == 1
        held = padded_units(b.units, tp)

        def local(size: int, node: fx.Node, b: Block = b, held: int = held) -> int:
            if b.replicas > 1:  # one KV head per rank; the query side in T equal shares
                return size // (tp // b.replicas) if node in b.kv else size // tp
            return size // b.units * held

        for x in dict.fromkeys(c.input for c in b.columns):  # one input, or a cross-attention's two (query; keys and values)
            first = min((c.node for c in b.columns if c.input is x), key=order.__getitem__)
            with graph.inserting_before(first):
                copied = graph.call_function(tp_copy, (x, group))
            copied.meta["val"] = x.meta.get("val")
            copied.meta.setdefault("dscompile", {})["shard"] = "tp_copy"
            for c in b.columns:
                if c.input is x:
                    c.node.replace_input_with(x, copied)
        _sum_whole_gradients(graph, b, trainable, group)
        for node, whole, dim in b.narrowed:
            _narrow(graph, node, whole, dim, rank, tp)
        for c in b.columns:
            parts = b.blocks[c.node]
            units = b.units if padded else 0
            replicas = b.replicas if c.node in b.kv else 1
            sections = _cut_sections(b.sections.get(c.node, {}), tp)
            slices[c.weight] = SliceSpec(dim=1 if c.transposed else 0, blocks=parts, units=units, replicas=replicas, sections=sections)
            if c.bias is not None:
                slices[c.bias] = SliceSpec(dim=0, blocks=parts, units=units, replicas=replicas, sections=sections)
            if replicas > 1:
                _sum_replica_gradients(graph, c, group, rank // replicas, tp // replicas)
        for node, (pos, size) in b.rewrites.items():
            if pos == -1:  # split(x, size): each part's size
                node.args = (node.args[0], local(size, node), *node.args[2:])
            elif pos == -2:  # split_with_sizes: every size
                node.args = (node.args[0], [local(s, node) for s in node.args[1]], *node.args[2:])  # type: ignore[union-attr]
            elif pos == -3:  # repeat_interleave's output_size
                node.kwargs = {**node.kwargs, "output_size": local(size, node)}
            else:
                sizes = list(node.args[1])  # type: ignore[arg-type]
                sizes[pos] = local(size, node)
                node.args = (node.args[0], sizes, *node.args[2:])
        for node, (pos, count) in b.repeats.items():  # replicated KV heads: each repeated for this rank's query heads only
            if pos == -1:  # repeat_interleave's repeats
                node.args = (node.args[0], count // b.replicas, *node.args[2:])
            else:  # repeat_kv's expand
                sizes = list(node.args[1])  # type: ignore[arg-type]
                sizes[pos] = count // b.replicas
                node.args = (node.args[0], sizes, *node.args[2:])
        for buffer, dim in b.states.items():
            slices[buffer] = SliceSpec(dim=dim, replicas=b.replicas if buffer in b.replicated_states else 1)
        row = b.row
        slices[row.weight] = SliceSpec(dim=0 if row.transposed else 1, units=b.units if padded else 0)
        node = row.node
        row_input = row.input
        if padded:
            row_input = _mask_padding(gm, row_input, f"_tp_padding_mask_{index}", b.units, rank, tp)
        with graph.inserting_after(node):
            if row.transposed:  # addmm(b, x, W) -> mm(x, W_slice), all-reduce, + b
                partial = graph.call_function(aten.mm.default, (row_input, node.args[2]))
            else:
                partial = graph.call_function(aten.linear.default, (row_input, node.args[1]))
        with graph.inserting_after(partial):
            reduced = graph.call_function(tp_reduce, (partial, group))
        last = reduced
        if row.bias is not None:
            bias_node = node.args[0] if row.transposed else node.args[2]
            with graph.inserting_after(reduced):
                last = graph.call_function(aten.add.Tensor, (reduced, bias_node))
        for n in (partial, reduced, last):
            n.meta["val"] = node.meta.get("val")
        reduced.meta.setdefault("dscompile", {})["shard"] = "tp_reduce"
        node.replace_all_uses_with(last)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return slices


def _narrow(graph: fx.Graph, node: fx.Node, whole: fx.Node, dim: int, rank: int, tp: int) -> None:
    """``node`` reads ``whole`` (or its ``tp_copy``) cut to this rank's part along ``dim``: a whole tensor per head or
    unit (T5's relative position bias) combined with the block's sliced values."""
    current = whole if whole in node.all_input_nodes else next(a for a in node.all_input_nodes if a.target is tp_copy and a.args[0] is whole)
    val = whole.meta["val"]
    size = int(val.shape[dim]) // tp
    with graph.inserting_before(node):
        cut = graph.call_function(aten.narrow.default, (current, dim, rank * size, size))
    cut.meta["val"] = val.narrow(dim, 0, size)
    cut.meta.setdefault("dscompile", {})["shard"] = "tp_narrow"
    node.replace_input_with(current, cut)


def _cut_sections(cuts: dict[fx.Node, tuple[int, int]], tp: int) -> tuple[int, ...]:
    """The fused parts' sizes, and each slice of the features moved to this rank's parts (each part split in TP)."""
    bounds = sorted(set(cuts.values()))
    for node, cut in cuts.items():
        i = bounds.index(cut)
        start = sum(b - a for a, b in bounds[:i]) // tp
        node.args = (node.args[0], node.args[1], start, start + (cut[1] - cut[0]) // tp, *node.args[4:])
    return tuple(b - a for a, b in bounds)


def _trainable_values(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on a trainable parameter (so a gradient flows back through them)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = attr_value(gm, str(node.target))
            if isinstance(value, nn.Parameter) and value.requires_grad:
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _sum_whole_gradients(graph: fx.Graph, b: Block, trainable: set[fx.Node], group: Any) -> None:
    """A whole value the block's sliced ops read and that carries a gradient (Qwen3's per-head norm weights, the
    block input read elsewhere than by its linears) gets on each rank only its heads' part of the gradient: it is
    read through ``tp_copy``, whose backward sums the parts over the TP group."""
    copies: dict[fx.Node, fx.Node] = {}
    for node in b.region:
        for value in node.all_input_nodes:
            if value in b.sharded or value not in trainable or getattr(value, "target", None) is tp_copy:
                continue
            if value not in copies:
                b.summed |= {str(p.target) for p in ancestors(value) if p.op == "get_attr" and p in trainable}
                with graph.inserting_after(value):
                    copies[value] = graph.call_function(tp_copy, (value, group))
                copies[value].meta["val"] = value.meta.get("val")
                copies[value].meta.setdefault("dscompile", {})["shard"] = "tp_copy"
            node.replace_input_with(value, copies[value])


def _sum_replica_gradients(graph: fx.Graph, column: Linear, group: Any, slot: int, slots: int) -> None:
    """The column reads its weight (and bias) through ``tp_sum_replicas``: the ranks sharing a KV head each hold a
    copy, and each computes only its query heads' part of its gradient."""
    for name in (column.weight, column.bias):
        if name is None:
            continue
        attr = next(a for a in column.node.all_input_nodes if a.op == "get_attr" and a.target == name)
        with graph.inserting_before(column.node):
            summed = graph.call_function(tp_sum_replicas, (attr, group, slot, slots))
        summed.meta["val"] = attr.meta.get("val")
        summed.meta.setdefault("dscompile", {})["shard"] = "tp_sum_replicas"
        column.node.replace_input_with(attr, summed)


def _mask_padding(gm: fx.GraphModule, x: fx.Node, name: str, units: int, rank: int, tp: int) -> fx.Node:
    """``x * mask``: ones over this rank's units of the last dimension, zeros over its padding."""
    val = x.meta["val"]  # still the unsplit value
    unit = int(val.shape[-1]) // units
    local_features = unit * padded_units(units, tp)
    mask = torch.zeros(local_features, dtype=val.dtype, device=val.device)
    mask[: units_of_rank(units, rank, tp)[1] * unit] = 1
    gm.register_buffer(name, mask)
    with gm.graph.inserting_after(x):
        attr = gm.graph.get_attr(name)
    with gm.graph.inserting_after(attr):
        masked = gm.graph.call_function(aten.mul.Tensor, (x, attr))
    attr.meta["val"] = val.new_empty(local_features)
    masked.meta["val"] = val
    masked.meta.setdefault("dscompile", {})["shard"] = "tp_padding_mask"
    return masked

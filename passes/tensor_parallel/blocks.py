"""Finding the blocks to split: every linear that adds to the residual stream, and the linears that feed it.

``find_blocks`` walks up from each residual-adding (row) linear to its column linears, runs ``Propagator`` over the
ops between, and decides the units to split (heads, KV-head groups, hidden units), padding, and replicated KV heads.
A block it cannot split is kept whole, with the reason logged and returned for the plan.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from dscompile.passes.tensor_parallel.graph_facts import ancestors, node_shape
from dscompile.passes.tensor_parallel.propagate import Propagator, Unsplittable
from dscompile.runtime.tensor_parallel import padded_units

log = logging.getLogger("dscompile.passes.tensor_parallel")  # the pass's one logger, whichever module logs
aten = torch.ops.aten


@dataclass
class Linear:
    """A linear layer in the ATen graph: ``linear(x, W[out, in], b)`` or GPT-2's ``addmm(b, x, W[in, out])``."""

    node: fx.Node
    weight: str
    bias: str | None
    transposed: bool  # W stored [in, out] (Conv1D)

    @property
    def input(self) -> fx.Node:
        return self.node.args[1] if self.transposed else self.node.args[0]  # type: ignore[return-value]


@dataclass
class Block:
    """A residual block the graph lets split: its column linears, its row linear and what the propagation found between."""

    columns: list[Linear]
    row: Linear
    region: list[fx.Node]
    sharded: dict[fx.Node, int]  # node -> its sliced dim
    blocks: dict[fx.Node, int]  # column node -> number of fused parts
    rewrites: dict[fx.Node, tuple[int, int]]  # shape-carrying node -> (arg position in its shape list, its full size)
    units: int  # the block's sliced sizes are multiples of this many units (heads or KV-head groups, hidden units)
    states: dict[str, int] = field(default_factory=dict)  # buffer written in place by the block (a KV cache) -> its sliced dim
    replicas: int = 1  # > 1: fewer KV heads than TP ranks, each held by this many ranks (``_replicated_kv``)
    kv: set[fx.Node] = field(default_factory=set)  # then: the block's KV-side nodes (one head per rank)
    repeats: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)  # then: where KV heads are repeated, and how often
    replicated_states: set[str] = field(default_factory=set)  # then: the buffers written from the KV side (a KV cache)
    sections: dict[fx.Node, dict[fx.Node, tuple[int, int]]] = field(default_factory=dict)  # column -> its feature slices -> [start, end)
    summed: set[str] = field(default_factory=set)  # once rewritten: whole parameters it reads whose gradient is summed over TP
    narrowed: list[tuple[fx.Node, fx.Node, int]] = field(default_factory=list)  # (op, whole input, dim): the input cut to this rank's part


def _param_name(node: Any) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def as_linear(node: fx.Node) -> Linear | None:
    """The linear layer ``node`` computes from named parameters, or None (the vocabulary head's finder reads it too)."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        weight = _param_name(node.args[1])
        bias = _param_name(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
        if weight is not None and (len(node.args) <= 2 or node.args[2] is None or bias is not None):
            return Linear(node, weight, bias, transposed=False)
    if node.target is aten.addmm.default and not node.kwargs:
        weight, bias = _param_name(node.args[2]), _param_name(node.args[0])
        if weight is not None and bias is not None:
            return Linear(node, weight, bias, transposed=True)
    return None


_PASSTHROUGH = {aten.dropout.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default}


def _adds_to_residual(node: fx.Node) -> bool:
    """The value reaches an ``add`` through single-use dropouts/views (the residual connection)."""
    for _ in range(6):
        if len(node.users) != 1:
            return False
        (user,) = node.users
        if user.target in (aten.add.Tensor, operator.add):  # a stream computed from the inputs, not a bias (BART's ``final_logits_bias``)
            other = [a for a in user.args if isinstance(a, fx.Node) and a is not node]
            return any(n.op == "placeholder" for a in other for n in ancestors(a))
        if user.target not in _PASSTHROUGH:
            return _adds_to_residual_after_norm(node)
        node = user
    return False


# what a norm applied to a block's output before the residual add is made of (Gemma2/3's and OLMo2's post-norms)
_NORM_OPS = _PASSTHROUGH | {
    aten._to_copy.default, aten.to.dtype, aten.pow.Tensor_Scalar, aten.mean.dim, aten.var_mean.correction, operator.getitem, aten.add.Tensor, aten.add.Scalar,
    aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.rsqrt.default, aten.sqrt.default, aten.type_as.default,
}  # fmt: skip


def _adds_to_residual_after_norm(node: fx.Node, limit: int = 24) -> bool:
    """The value is normalised (its every use one of a norm's ops) and then added to the residual stream: an ``add``
    of the normalised value and a same-shaped tensor that does not come from it. A row-parallel linear's output is
    all-reduced right after the linear, so the norm sees the whole value."""
    shape = node_shape(node)
    derived = {node}
    frontier = [node]
    residual = None
    while frontier:
        for user in frontier.pop().users:
            if user in derived or user is residual:
                continue
            others = [a for a in user.all_input_nodes if a not in derived]
            same_shape = node_shape(user) == shape and len(others) == 1 and node_shape(others[0]) == shape
            if user.target is aten.add.Tensor and same_shape and node not in ancestors(others[0]):
                if residual is not None:
                    return False
                residual = user
                continue
            if user.target not in _NORM_OPS or len(derived) >= limit:
                return False
            derived.add(user)
            frontier.append(user)
    return residual is not None


def _region(row: Linear, linears: dict[fx.Node, Linear]) -> tuple[list[Linear], set[fx.Node]]:
    """Walk up from the row linear's input to the linears feeding it; the nodes in between."""
    columns: dict[fx.Node, Linear] = {}
    seen: set[fx.Node] = set()
    stack = [row.input]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in linears:
            columns[node] = linears[node]
            continue
        if node.op != "call_function":
            continue
        stack.extend(node.all_input_nodes)
    return list(columns.values()), seen


def _units(prop: Propagator, nodes: Any = None) -> int:
    """The most units every sliced size of the block (or of ``nodes`` in it) is a whole multiple of (their gcd):
    heads, or KV-head groups under GQA (a query head is sliced with its KV head), or hidden units; the split is in these."""
    sizes = []
    for node, dim in prop.sharded.items():
        shape = node_shape(node)
        if shape is not None and (nodes is None or node in nodes):
            sizes.append(shape[dim] // prop.blocks.get(node, 1))  # a fused projection: each of its parts
    sizes += [size for node, (pos, size) in prop.rewrites.items() if pos == -1 and (nodes is None or node in nodes)]  # split(x, size): each part
    units = math.gcd(*sizes)
    if units < 1:
        raise Unsplittable("a sliced dimension has size 0")
    return units


def _kv_side(prop: Propagator) -> set[fx.Node]:
    """The sliced nodes upstream of the ops that turn KV heads into query heads (the k/v projections to those ops)."""
    kv: set[fx.Node] = set()
    stack = [x for inputs in prop.conversions.values() for x in inputs if x in prop.sharded]
    while stack:
        node = stack.pop()
        if node not in kv:
            kv.add(node)
            stack.extend(a for a in node.all_input_nodes if a in prop.sharded)
    return kv


def _replicated_kv(prop: Propagator, units: int, tp: int) -> tuple[int, set[fx.Node], str]:
    """Megatron's answer to fewer KV heads ``K`` than ranks ``T``: when ``T % K == 0`` and ``T`` divides the query
    heads ``H``, rank ``r`` holds query heads ``[r H/T, (r+1) H/T)`` and one copy of their KV head ``r K / T``
    (``T/K`` ranks per KV head). ``(T/K, KV-side nodes, "")``, or ``(1, {}, why not)``: then the block is padded."""
    if units % tp == 0 or not prop.conversions:
        return 1, set(), ""
    kv = _kv_side(prop)
    for node in kv:
        for user in node.users:
            if user in prop.sharded and user not in kv and node not in prop.conversions.get(user, ()):
                return 1, set(), f"{node.name} feeds both the KV heads and the query heads"
    query = set(prop.sharded) - kv
    kv_units, query_units = _units(prop, kv), _units(prop, query)
    if tp % kv_units or query_units % tp or query_units % kv_units:
        return 1, set(), f"{kv_units} KV heads do not divide TP={tp}, or TP does not divide {query_units} query heads"
    return tp // kv_units, kv, ""


def _analyse(prop: Propagator, columns: list[Linear], row: Linear, region: list[fx.Node]) -> Propagator:
    """Follow the sliced dimension through the block and check the row linear reads it as its features."""
    for c in columns:
        prop.seed(c.node)
    for n in region:
        prop.visit(n)
    for column, cuts in prop.sections.items():
        bounds = sorted(set(cuts.values()))
        size = node_shape(column)[-1]  # type: ignore[index]
        if bounds[0][0] != 0 or bounds[-1][1] != size or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            raise Unsplittable(f"the slices of {column.name}'s features {bounds} do not cut it into parts")
    if row.input not in prop.sharded:
        raise Unsplittable("its input does not come from the feeding linears")
    last = node_shape(row.input)
    if prop.sharded[row.input] != len(last) - 1:  # type: ignore[arg-type]
        raise Unsplittable("its input is sliced along another dimension than its features")
    return prop


def find_blocks(gm: fx.GraphModule, tp: int) -> tuple[list[Block], list[dict[str, Any]]]:
    """Every residual block the graph allows splitting, and the residual linears it does not (with why)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    linears = {n: lin for n in gm.graph.nodes if (lin := as_linear(n)) is not None}
    blocks: list[Block] = []
    whole: list[dict[str, Any]] = []
    for row in linears.values():
        if not _adds_to_residual(row.node):
            continue
        columns, walked = _region(row, linears)
        try:
            if not columns:
                raise Unsplittable("no linear feeds it")
            region = sorted((n for n in walked if n not in linears and n.op == "call_function"), key=order.__getitem__)
            prop = Propagator(tp)
            try:
                _analyse(prop, columns, row, region)
            except Unsplittable as first:
                if not prop.ambiguous:
                    raise
                try:  # a view may have split the features as one head (one KV head: MQA): read it that way
                    prop = _analyse(Propagator(tp, heads_of_one=True), columns, row, region)
                except Unsplittable as again:
                    raise Unsplittable(f"{first}; reading size-one view dims as one head: {again}") from None
            sliced_region = [n for n in region if n in prop.sharded]
            inside = set(sliced_region) | {c.node for c in columns}
            for n in inside:
                outside = [u.name for u in n.users if u not in inside and u is not row.node]
                if outside:
                    raise Unsplittable(f"{n.name} is also used outside the block ({', '.join(outside)})")
            units = _units(prop)
            replicas, kv, why = _replicated_kv(prop, units, tp)
            if prop.sections and (replicas > 1 or units % tp):
                raise Unsplittable(f"a projection fused of parts of unequal sizes whose {units} units TP={tp} does not divide")
            if replicas > 1:
                log.info("tensor_parallel: %s: %d KV heads on TP=%d, each held by %d ranks with their query heads", row.weight, tp // replicas, tp, replicas)
            elif units % tp:
                padded = padded_units(units, tp) * tp
                log.info("tensor_parallel: %s splits %d units (heads or hidden units) over TP=%d, padded with zeros to %d", row.weight, units, tp, padded)
                if why:
                    log.info("tensor_parallel: %s: KV heads not replicated: %s", row.weight, why)
            if prop.narrowed and (units % tp or prop.sections or any(n != 1 for n in prop.blocks.values())):
                whole_name = prop.narrowed[0][1].name
                raise Unsplittable(f"a whole tensor per head or unit ({whole_name}) read with {units} units TP={tp} does not divide, or by a fused projection")
            block = Block(columns, row, sliced_region, prop.sharded, prop.blocks, prop.rewrites, units, prop.states, sections=prop.sections)
            block.narrowed = prop.narrowed
            if replicas > 1:
                block.replicas, block.kv, block.repeats = replicas, kv, prop.repeats
                block.replicated_states = {name for name, writer in prop.writers.items() if writer in kv}
            blocks.append(block)
        except Unsplittable as exc:
            whole.append({"row": row.weight, "columns": [c.weight for c in columns], "reason": str(exc)})
            log.warning("tensor_parallel: %s stays replicated: %s", row.weight, exc)
    return blocks, whole

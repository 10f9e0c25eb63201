"""Graph clean-up passes every pipeline runs: dead code, common subexpressions, no-op views."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from dscompile.graph import node_value
from dscompile.pipeline import PassContext, register_pass

aten = torch.ops.aten

# Random and impure ops must never be merged or dropped.
_NONDETERMINISTIC_TAG = torch.Tag.nondeterministic_seeded


@register_pass("dce", graphs=("pre_autograd", "joint", "forward", "backward"))
def dead_code_elimination(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Remove nodes whose results nobody uses (side-effecting ops such as collectives and copies stay)."""
    _eliminate_dead_code(gm)
    return gm


def _eliminate_dead_code(gm: torch.fx.GraphModule) -> None:
    """fx's ``eliminate_dead_code`` with ``_is_impure`` here and in every subgraph the graph reads (an
    ``autograd.Function``'s forward and backward bodies, ``cond`` branches): fx recurses into those with
    its default rule, which drops an unused in-place method, e.g. the ``x.copy_(all_reduce(x))`` that
    Dynamo makes of a Megatron layer's ``dist.all_reduce(x)``."""
    graph = gm.graph
    graph.lint()
    for node in reversed(graph.nodes):
        if not node.users and not _is_impure(node):
            graph.erase_node(node)
    read = {str(n.target) for n in graph.find_nodes(op="get_attr")}
    for name, child in gm.named_children():
        if name in read and isinstance(child, torch.fx.GraphModule):
            _eliminate_dead_code(child)
            child.recompile()


def _is_impure(node: torch.fx.Node) -> bool:
    """fx's rule, plus in-place Tensor methods: fx treats every ``call_method`` as pure, so a Dynamo
    graph's ``cache.index_copy_(...)`` or ``counter.add_(1)`` whose result is unused would be dropped
    (a static KV cache would then never be written)."""
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("__"):
        return True
    return node.is_impure()


def _is_pure(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if _NONDETERMINISTIC_TAG in target.tags or target._schema.is_mutable:
        return False
    return target.namespace == "aten" and not any(r.alias_info is not None and r.alias_info.is_write for r in target._schema.returns)


def _freeze(value: object) -> object:
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ("torch", str(value))
    if isinstance(value, torch.SymInt):
        return ("sym", str(value))
    return value


@register_pass("cse", graphs=("joint", "forward", "backward"))
def common_subexpression_elimination(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Merge identical pure aten computations on the same inputs (random ops are never merged)."""
    seen: dict[object, torch.fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not _is_pure(node):
            continue
        try:
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
            hash(key)
        except TypeError:
            continue
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    return gm


def _same_shape(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    out, inp = node_value(node), node_value(source)
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return False
    return (
        out.dtype == inp.dtype
        and out.device == inp.device
        and len(out.shape) == len(inp.shape)
        and all(isinstance(a, int) and isinstance(b, int) and a == b for a, b in zip(out.shape, inp.shape))
        and tuple(out.stride()) == tuple(inp.stride())
    )


_NOOP_WHEN_SAME: dict[object, Callable[[torch.fx.Node], bool]] = {
    aten.view.default: lambda n: True,
    aten._unsafe_view.default: lambda n: True,
    aten.reshape.default: lambda n: True,
    aten.expand.default: lambda n: True,
    aten.alias.default: lambda n: True,
    aten.slice.Tensor: lambda n: True,
}


@register_pass("noop_views", graphs=("joint", "forward", "backward"))
def remove_noop_views(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Drop views, reshapes, expands and slices whose result has the input's exact shape and strides."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in list(gm.graph.nodes):
        check = _NOOP_WHEN_SAME.get(node.target)
        if check is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        source = node.args[0]
        # Graph outputs keep their identity: AOTAutograd recorded how they alias inputs.
        if output in node.users or not _same_shape(node, source) or not check(node):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
    return gm

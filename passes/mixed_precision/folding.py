"""Cast recognition and folding, on any graph kind (Dynamo's and AOTAutograd's).

``cast_source`` recognises a pure dtype conversion in every spelling; ``fold_casts`` drops casts to a value's own dtype
and shortcuts chains whose middle dtype holds the source exactly, so the casts the policy inserts cost nothing twice.
"""

from __future__ import annotations

import torch
import torch.fx

from dscompile.graph import node_value

aten = torch.ops.aten
prims = torch.ops.prims

_METHOD_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}

# dtype -> the dtypes it represents exactly (a round trip through it loses nothing).
_HOLDS_EXACTLY = {
    torch.float64: {torch.float64, torch.float32, torch.bfloat16, torch.float16},
    torch.float32: {torch.float32, torch.bfloat16, torch.float16},
    torch.bfloat16: {torch.bfloat16},
    torch.float16: {torch.float16},
}


def _same_place(node: torch.fx.Node, src: torch.fx.Node) -> bool:
    """A ``_to_copy`` that changes nothing but the dtype (same device, strided, format kept)."""
    extra = set(node.kwargs) - {"dtype", "layout", "device"}
    if extra or node.kwargs.get("layout", torch.strided) != torch.strided:
        return False
    value = node_value(src)
    device = node.kwargs.get("device")
    return device is None or (isinstance(value, torch.Tensor) and torch.device(device) == value.device)


def cast_source(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype] | None:
    """``(input, dtype)`` when ``node`` is a pure dtype conversion, else None."""
    args, kwargs = node.args, node.kwargs
    if not args or not isinstance(args[0], torch.fx.Node):
        return None
    if node.op == "call_function":
        if node.target is aten._to_copy.default and len(args) == 1 and "dtype" in kwargs and _same_place(node, args[0]):
            return args[0], kwargs["dtype"]
        if node.target is prims.convert_element_type.default and len(args) == 2:
            return args[0], args[1]
    if node.op == "call_method":
        if node.target in _METHOD_CASTS and len(args) == 1 and not kwargs:
            return args[0], _METHOD_CASTS[node.target]
        if node.target == "to" and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
            return args[0], args[1]
    return None


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    value = node_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _is_mutated(node: torch.fx.Node) -> bool:
    for user in node.users:
        if user.op == "call_method" and str(user.target).endswith("_") and user.args and user.args[0] is node:
            return True
        if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
            return True
    return False


def count_casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if cast_source(n) is not None)


def fold_casts(gm: torch.fx.GraphModule) -> int:
    """Remove casts to a value's own dtype and shortcut lossless cast chains; returns casts removed."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    before = count_casts(gm)
    for node in list(graph.nodes):
        found = cast_source(node)
        if found is None:
            continue
        src, dtype = found
        # Walk back through casts that held their input exactly: cast(cast(x, a), b) == cast(x, b).
        while (inner := cast_source(src)) is not None and _dtype(inner[0]) in _HOLDS_EXACTLY.get(inner[1], ()):
            src = inner[0]
        if output in node.users or _is_mutated(node) or _is_mutated(src):
            continue  # outputs keep their identity (aliasing was recorded); mutations need copies
        if _dtype(src) == dtype:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
        elif src is not node.args[0]:
            node.args = (src, *node.args[1:])
    for node in reversed(list(graph.nodes)):
        if cast_source(node) is not None and not node.users:
            graph.erase_node(node)
    return before - count_casts(gm)

"""What the partitioner measures of a graph, once: per node FLOPs, memory and layer; per boundary the bytes crossing.

Every partition method reads these arrays (``GraphFacts``); ``module_path`` and ``layer_of`` name where a node was traced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx

from dscompile.cost import evaluate, nbytes, node_cost
from dscompile.graph import is_collective, node_value
from dscompile.runtime.pipeline_markers import is_marker

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


_PATH_PREFIXES = re.compile(r"^(L\['self'\]\.|L\['self'\]|self\.)")


def module_path(node: torch.fx.Node, strip: str = "") -> str:
    """The dotted name of the innermost module a node was traced in ('' at the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    text = _PATH_PREFIXES.sub("", str(raw))
    text = text.replace("_modules['", "").replace("']", "").replace("._modules", "")
    if strip and (text == strip.rstrip(".") or text.startswith(strip)):
        text = text[len(strip) :]
    return text


def _module_types(node: torch.fx.Node, strip: str = "") -> dict[str, str]:
    found: dict[str, str] = {}
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        text = _PATH_PREFIXES.sub("", str(path)).replace("_modules['", "").replace("']", "").replace("._modules", "")
        if strip and text.startswith(strip):
            text = text[len(strip) :]
        found[text] = getattr(cls, "__name__", str(cls))
    return found


def layer_of(path: str) -> str:
    """The 'layer' a module path belongs to: its first component, plus the index of a list item."""
    if not path:
        return ""
    parts = path.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _value_bytes(node: torch.fx.Node) -> int:
    value = node_value(node)
    if isinstance(value, torch.Tensor):
        return int(evaluate(nbytes(value)))
    return 0


def _is_plain_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node_value(node), torch.Tensor)


def _starts_collective(node: torch.fx.Node) -> bool:
    """A functional collective (tensor parallelism's all-reduces): its result is only usable after its
    ``wait_tensor``, on the same rank."""
    return is_collective(node) and node.target is not torch.ops._c10d_functional.wait_tensor.default


@dataclass
class GraphFacts:
    """Per compute node (in order): FLOPs, memory, layer; per boundary: bytes crossing, validity."""

    nodes: list[torch.fx.Node]
    flops: torch.Tensor  # float64, one per node (torch, not numpy: numpy is no dependency of dscompile)
    memory: torch.Tensor
    layers: list[str]
    layer_types: dict[str, str]
    param_count: torch.Tensor
    cut_bytes: torch.Tensor  # cut_bytes[i]: bytes of values crossing the boundary in front of node i
    cut_valid: torch.Tensor  # bool
    markers: list[int]  # boundaries where a pipeline_split() marker stood


def graph_facts(gm: torch.fx.GraphModule, param_nodes: set[torch.fx.Node], strip: str = "") -> GraphFacts:
    """Measure the graph once; every partition method reads these arrays."""
    nodes: list[torch.fx.Node] = []
    markers: list[int] = []
    for node in gm.graph.nodes:
        if is_marker(node):
            markers.append(len(nodes))
        elif node.op in _COMPUTE_OPS:
            nodes.append(node)
    index = {node: i for i, node in enumerate(nodes)}
    n = len(nodes)
    flops = torch.zeros(n, dtype=torch.float64)
    memory = torch.zeros(n, dtype=torch.float64)
    params = torch.zeros(n, dtype=torch.float64)
    layers: list[str] = []
    layer_types: dict[str, str] = {}
    seen_params: set[torch.fx.Node] = set()
    previous = ""
    for i, node in enumerate(nodes):
        flops[i] = float(evaluate(node_cost(node).flops))
        memory[i] = _value_bytes(node)  # activations kept for backward (an upper estimate)
        for arg in node.all_input_nodes:
            if arg in param_nodes and arg not in seen_params:
                seen_params.add(arg)
                value = node_value(arg)
                # parameter, gradient and two optimizer states per element
                memory[i] += 4 * _value_bytes(arg)
                if isinstance(value, torch.Tensor):
                    params[i] += value.numel()
        layer = layer_of(module_path(node, strip)) or previous  # root-level ops join the layer before them
        layers.append(layer)
        previous = layer
        for path, cls in _module_types(node, strip).items():
            if path == layer:
                layer_types[layer] = cls
    if layers and not layers[0]:
        first = next((name for name in layers if name), "")
        layers = [name or first for name in layers]
    # bytes crossing each boundary: values made before it and used after it
    diff = torch.zeros(n + 2, dtype=torch.float64)
    valid = torch.ones(n + 1, dtype=torch.bool)
    for node in gm.graph.nodes:
        if node.op not in _COMPUTE_OPS or node not in index:
            continue
        users = [index[u] for u in node.users if u in index]
        if not users:
            continue
        start, last = index[node] + 1, max(users)
        if last < start:
            continue
        diff[start] += _value_bytes(node)
        diff[last + 1] -= _value_bytes(node)
        if not _is_plain_tensor(node) or _starts_collective(node):
            # tuples, sizes and None cannot travel between ranks; a collective must be waited where it started
            valid[start : last + 1] = False
    cut_bytes = torch.cumsum(diff, 0)[: n + 1]
    valid[0] = valid[n] = True
    return GraphFacts(nodes, flops, memory, layers, layer_types, params, cut_bytes, valid, markers)

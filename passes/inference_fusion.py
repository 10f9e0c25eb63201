"""Inference fusion found in the captured graph (what DeepSpeed-Inference's kernel injection does per architecture).

``fuse_shared_input_matmuls`` (on the Dynamo graph, inference only): linear layers that read the
same input (an attention block's Q, K and V projections; a gated MLP's gate and up projections)
become one matmul against the rows of their weights stacked once at compile time, whose output is
split back into the original results. One wide matmul instead of two or three narrow ones reads the
input once and launches one kernel, which is what DeepSpeed's fused QKV GEMM buys; here it is a
graph pattern, not a per-architecture container, so any model whose graph has the pattern gets it.

The stacked weight (and bias) is an extra input of the compiled graph (``lift_tensor``), built from
the parameters once and rebuilt only if they are replaced or modified in place (``StackedRows``),
so a decode step reads one copy, not a fresh concatenation per call. The pass runs only with
gradients off (the engine's graphs): stacking would cut the weights off from their gradients. A
linear whose weight is not a graph input (a weight computed in the graph, e.g. dequantized from
packed int8) is left alone and logged. The stacked copy costs memory: one extra copy of the fused
weights.

Nodes created carry ``meta["dscompile"]["inference_fusion"] = {"fused": [names of the replaced nodes]}``.
Bias + activation and residual + norm epilogues are left to the lowering (Inductor fuses them on
CPU; the Triton lowering's matmul-epilogue template on GPU).
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict

import torch
import torch.fx
import torch.nn.functional as F

from dscompile.graph import ds_meta, lift_tensor, node_value, set_fake_value
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.inference_fusion")

aten = torch.ops.aten

# the torch-level spellings (a model's own Dynamo graph) and the ATen one (a graph captured with
# ``torch.export`` and split by tensor parallelism, which Dynamo then traces op by op)
LINEAR_TARGETS = (torch._C._nn.linear, F.linear, aten.linear.default)


def _placeholder_input(gm: torch.fx.GraphModule, node: object, ctx: PassContext) -> tuple[int, torch.Tensor] | None:
    """``(input position, real tensor)`` of a weight/bias argument that is a graph input, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    index = [n for n in gm.graph.nodes if n.op == "placeholder"].index(node)
    if index < len(ctx.example_inputs):
        value = ctx.example_inputs[index]
        if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
            return index, value
    return None


class StackedRows:
    """The rows of several inputs stacked, fetched from each call's own inputs.

    Dynamo reuses a graph for every instance of a model class (parameters are inputs), so the
    stacked tensor is rebuilt whenever the inputs are other tensors or were modified in place
    (their version counters), and reused otherwise: one copy per model, not one per call.
    """

    def __init__(self, positions: list[int]) -> None:
        self.positions = positions
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, inputs) -> torch.Tensor:
        parts = [inputs[i] for i in self.positions]
        key = tuple((id(t), t._version) for t in parts)
        if key != self._key or self._value is None:
            with torch.no_grad():
                self._value = torch.cat([t.detach() for t in parts], dim=0)
            self._key = key
        return self._value


def _linear_parts(node: torch.fx.Node) -> tuple[torch.fx.Node, object, object]:
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    return x, weight, bias


def shared_input_groups(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """Linear calls grouped by the input node they read (groups of two or more)."""
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in LINEAR_TARGETS:
            x = _linear_parts(node)[0]
            if isinstance(x, torch.fx.Node):
                groups[x].append(node)
    return [members for members in groups.values() if len(members) > 1]


def _fuse_group(gm: torch.fx.GraphModule, ctx: PassContext, members: list[torch.fx.Node]) -> bool:
    names = [n.name for n in members]
    weights = [_placeholder_input(gm, _linear_parts(n)[1], ctx) for n in members]
    if any(w is None or w[1].dim() != 2 for w in weights):
        log.info("%s: %s share an input but not all weights are 2-D graph inputs; left unfused", ctx.graph_name, names)
        return False
    if len({(w.dtype, w.device, w.shape[1]) for _, w in weights}) != 1:
        log.info("%s: %s share an input but their weights differ in dtype, device or width; left unfused", ctx.graph_name, names)
        return False
    bias_nodes = [_linear_parts(n)[2] for n in members]
    biases = [_placeholder_input(gm, b, ctx) for b in bias_nodes]
    has_bias = not all(b is None for b in bias_nodes)
    if has_bias and any(b is None for b in biases):
        log.info("%s: %s: some have a bias and some not (or a bias that is not a graph input); left unfused", ctx.graph_name, names)
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(members, key=order.__getitem__)
    x = _linear_parts(first)[0]
    stack_w = StackedRows([i for i, _ in weights])
    w_node = lift_tensor(gm, f"{first.name}_stacked_weight", stack_w(_inputs_view(weights)), stack_w)
    b_node = None
    if has_bias:
        stack_b = StackedRows([i for i, _ in biases])
        b_node = lift_tensor(gm, f"{first.name}_stacked_bias", stack_b(_inputs_view(biases)), stack_b)
    with gm.graph.inserting_before(first):
        fused = gm.graph.call_function(torch._C._nn.linear, (x, w_node, b_node))
        set_fake_value(fused)
        sizes = [int(w.shape[0]) for _, w in weights]
        split = gm.graph.call_function(torch.split, (fused, sizes), {"dim": -1})
        set_fake_value(split)
    for field in ("nn_module_stack", "stack_trace"):
        if field in first.meta:
            fused.meta[field] = first.meta[field]
    ds_meta(fused)["inference_fusion"] = {"fused": names}
    anchor = split
    for i, node in enumerate(members):
        with gm.graph.inserting_after(anchor):
            piece = gm.graph.call_function(operator.getitem, (split, i))
        piece.meta["val"] = node_value(split)[i]
        anchor = piece
        node.replace_all_uses_with(piece)
        gm.graph.erase_node(node)
    return True


def _inputs_view(found: list) -> dict[int, torch.Tensor]:
    """The example inputs by position, as ``StackedRows`` reads a call's inputs."""
    return {i: t for i, t in found}


@register_pass("fuse_shared_input_matmuls", graphs=("pre_autograd",))
def fuse_shared_input_matmuls(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Linear layers reading the same input (Q/K/V, gate/up) become one matmul on stacked weights (inference only)."""
    if torch.is_grad_enabled():
        log.info("%s: gradients are on; stacking weights would cut them off from training, nothing fused", ctx.graph_name)
        return gm
    fused = 0
    for members in shared_input_groups(gm):
        fused += _fuse_group(gm, ctx, members)
    gm.graph.lint()
    gm.recompile()
    ctx.analysis.setdefault("inference_fusion", {})[ctx.graph_name] = fused
    log.info("%s: %d groups of linear layers sharing an input fused", ctx.graph_name, fused)
    return gm

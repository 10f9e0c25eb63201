"""Bias + activation and residual + norm found in the captured graph and grouped as fused regions.

DeepSpeed-Inference hand-writes a container per architecture that calls fused "bias + GeLU" and
"residual + LayerNorm" kernels. Here ``fuse_inference_epilogues`` (pre-autograd graph, inference
only) finds the same regions from the graph's structure, with nothing per architecture:

- **bias + activation**: a matmul (``linear``/``addmm``/``matmul``, or one output of a stacked
  matmul split by ``fuse_shared_input_matmuls``), then the pointwise ops computed from it alone
  (free views included) up to an activation: ``gelu``/``silu``/``relu``/``sigmoid``, or one written
  out (GPT-2's tanh GeLU is eight pointwise ops);
- **residual + norm**: an ``add`` of two tensors (the residual stream) and the normalization computed
  from the sum: ``layer_norm``/``rms_norm``, or an RMSNorm written out (``pow``, ``mean``,
  ``rsqrt``, the weight).

A region grows from its root through pointwise ops, views and (for norms) last-dim reductions whose
tensor inputs are all in the region, parameters or graph inputs, so it is convex and never takes in a
second activation stream (Llama's ``silu(gate) * up`` keeps the product outside). Each region becomes
one ``call_module`` node (``ds_epilogue_N``, ``torch.fx``'s fuser utilities): the graph (and the dump) says what is fused and each region is checked
against eager by the tests. AOTAutograd inlines the region, so its ops reach the lowering together:
Inductor fuses the pointwise epilogue (and the norm's reduction) into one kernel on CPU, the matmul
itself staying a library call; on a GPU the Triton lowering folds matmul + epilogue into its matmul
template (``kernels/matmul_epilogue.py``).
Nodes created carry ``meta["dscompile"]["inference_fusion"] = {"region": kind}``; the counts go to
``ctx.analysis["inference_epilogues"][graph] = {"bias_activation": n, "residual_norm": m}``.
"""

from __future__ import annotations

import heapq
import logging
import operator
from collections.abc import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.passes.utils.fuser_utils import erase_nodes, fuse_as_graphmodule, insert_subgm

from dscompile.graph import ds_meta, node_value
from dscompile.pipeline import PassContext, register_pass

log = logging.getLogger("dscompile.passes.inference_epilogues")

aten = torch.ops.aten
# Each set holds the torch-level spellings (a model's Dynamo graph) and the ATen ones (a graph captured
# with ``torch.export`` and split by tensor parallelism, which Dynamo then traces op by op).
MATMULS = {
    torch._C._nn.linear,
    F.linear,
    torch.addmm,
    torch.matmul,
    operator.matmul,
    aten.linear.default,
    aten.addmm.default,
    aten.mm.default,
    aten.matmul.default,
}
ACTIVATIONS = {
    F.gelu, F.silu, F.relu, torch.relu, torch.sigmoid, torch.tanh, torch.erf, F.sigmoid, F.tanh,
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default, aten.erf.default,
}  # fmt: skip
ACTIVATION_METHODS = {"relu", "sigmoid", "tanh", "erf"}
NORMS = {
    F.layer_norm,
    getattr(F, "rms_norm", F.layer_norm),
    torch.rsqrt,
    aten.layer_norm.default,
    aten.rsqrt.default,
    *([aten.rms_norm.default] if hasattr(aten, "rms_norm") else []),
}
NORM_METHODS = {"rsqrt"}
POINTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.neg, torch.sqrt, torch.exp,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
    aten.div.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.sqrt.default, aten.exp.default, aten.to.dtype,
    aten._to_copy.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
}  # fmt: skip
POINTWISE_METHODS = {"add", "sub", "mul", "div", "pow", "neg", "sqrt", "exp", "to", "float", "type_as", "view", "reshape"}
REDUCTIONS = {torch.mean, aten.mean.dim}
REDUCTION_METHODS = {"mean"}
ADDS = {operator.add, torch.add, aten.add.Tensor}
REGION_PREFIX = "ds_epilogue_"


def _is(node: torch.fx.Node, funcs: set, methods: set) -> bool:
    if node.op == "call_function":
        return node.target in funcs
    return node.op == "call_method" and node.target in methods


def _is_tensor(arg: object) -> bool:
    return isinstance(arg, torch.fx.Node) and isinstance(node_value(arg), torch.Tensor)


def _leaf(arg: torch.fx.Node) -> bool:
    """An input a region may read from outside: a graph input (parameters are inputs) or a non-tensor (a size)."""
    return arg.op in ("placeholder", "get_attr") or not _is_tensor(arg)


def grow(root: torch.fx.Node, joinable: Callable[[torch.fx.Node], bool], taken: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """``root`` and every node computed from the region alone (plus leaves) through ``joinable`` ops, in graph order."""
    region = {root}
    order = list(root.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    for node in order[position[root] + 1 :]:
        if node in taken or node.op not in ("call_function", "call_method") or not joinable(node):
            continue
        inputs = node.all_input_nodes
        if any(a in region for a in inputs) and all(a in region or _leaf(a) for a in inputs):
            region.add(node)
    return sorted(region, key=position.__getitem__)


def _pointwise_or_view(node: torch.fx.Node) -> bool:
    return _is(node, POINTWISE | ACTIVATIONS, POINTWISE_METHODS | ACTIVATION_METHODS)


def _norm_op(node: torch.fx.Node) -> bool:
    return _pointwise_or_view(node) or _is(node, NORMS | REDUCTIONS, NORM_METHODS | REDUCTION_METHODS)


def _matmul_root(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in MATMULS:
        return True
    if node.op == "call_function" and node.target is operator.getitem:  # one part of a stacked (QKV, gate/up) matmul
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and src.target is torch.split and isinstance(src.args[0], torch.fx.Node) and src.args[0].target in MATMULS
    return False


def find_regions(gm: torch.fx.GraphModule) -> list[tuple[str, list[torch.fx.Node]]]:
    """The residual + norm regions, then the bias + activation regions (disjoint), in graph order."""
    taken: set[torch.fx.Node] = set()
    regions: list[tuple[str, list[torch.fx.Node]]] = []
    for node in gm.graph.nodes:
        if node not in taken and node.op == "call_function" and node.target in ADDS and sum(_is_tensor(a) for a in node.args[:2]) == 2:
            region = grow(node, _norm_op, taken)
            if any(_is(n, NORMS, NORM_METHODS) for n in region):
                regions.append(("residual_norm", region))
                taken.update(region)
    for node in gm.graph.nodes:
        if node not in taken and _matmul_root(node):
            region = grow(node, _pointwise_or_view, taken)
            if any(_is(n, ACTIVATIONS, ACTIVATION_METHODS) for n in region):
                regions.append(("bias_activation", region))
                taken.update(region)
    return regions


def _set_values(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """``meta['val']`` of a new region call (and its getitems) from the submodule run on the inputs' fake values."""
    args = [node_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
    fake_mode = next((a.fake_mode for a in args if isinstance(a, torch._subclasses.FakeTensor)), None)
    if fake_mode is None:
        return
    with fake_mode, torch.no_grad():
        value = gm.get_submodule(str(node.target))(*args)
    node.meta["val"] = value
    for user in node.users:
        if user.target is operator.getitem:
            user.meta["val"] = value[user.args[1]]


def _sort_in_place(graph: torch.fx.Graph) -> None:
    """Topological order, otherwise the original one, by moving the same nodes.

    A region's call sits where its last node was, so a node between its first and last that reads
    one of its outputs must move after it. In place, not a new graph: the passes edit Dynamo's own
    graph, whose node objects Dynamo reads back after the backend returns."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    waiting = {n: len(n.all_input_nodes) for n in graph.nodes}
    ready = [(position[n], n) for n in graph.nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[torch.fx.Node] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (position[user], user))
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in order:
        if node is not output:
            output.prepend(node)


@register_pass("fuse_inference_epilogues", graphs=("pre_autograd",))
def fuse_inference_epilogues(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """Bias + activation and residual + norm regions become one ``call_module`` each (inference only)."""
    counts = {"bias_activation": 0, "residual_norm": 0}
    if torch.is_grad_enabled():
        log.info("%s: gradients are on; epilogue regions are grouped for inference graphs only", ctx.graph_name)
        return gm
    regions = find_regions(gm)
    for kind, _ in regions:
        counts[kind] += 1
    for i, (_, nodes) in enumerate(regions):
        sub, inputs, outputs = fuse_as_graphmodule(gm, nodes, f"{REGION_PREFIX}{i}")
        insert_subgm(gm, sub, inputs, outputs)
        erase_nodes(gm, nodes)
    if regions:
        _sort_in_place(gm.graph)
    kinds = {f"{REGION_PREFIX}{i}": kind for i, (kind, _) in enumerate(regions)}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in kinds:
            ds_meta(node)["inference_fusion"] = {"region": kinds[str(node.target)]}
            _set_values(gm, node)
    gm.graph.lint()
    gm.recompile()
    ctx.analysis.setdefault("inference_epilogues", {})[ctx.graph_name] = counts
    log.info("%s: %d bias + activation and %d residual + norm regions fused", ctx.graph_name, counts["bias_activation"], counts["residual_norm"])
    return gm

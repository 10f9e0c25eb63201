"""Decode-step matmuls as weight-streaming reductions (``decode_gemv``), for Inductor on CPU.

Why: a decode step multiplies a handful of rows (one token per sequence) by every weight of the
model, so it is bound by the bytes of weight it reads. ATen's ``mm`` for one row reads the fp32 weight
at a fraction of the memory bandwidth on CPU (measured in ``bench/inference.py``: 32000x768 at
M=1, 7.2 ms for ``mm`` against 3.5 ms for an Inductor reduction), and a quantized weight is worse
off: the graph dequantizes it into a full float copy (written, then read again by ``mm``) on every
call. Written as ``sum(x[:, None, :] * W[None, :, :], -1)`` the product becomes one Inductor reduction
loop that streams each weight row once, with a dequantizing producer (int8 codes times scales, int4
unpacking) inlined into the loop, so a packed weight is read as its packed bytes (0.78 ms for the
int8 32000x768 head).

What: on inference forward graphs lowered by Inductor on CPU, every ``mm`` / ``addmm`` (``alpha``
and ``beta`` 1) whose left operand has at most ``max_rows`` rows becomes that reduction
(``max_rows_packed`` when the weight is computed in the graph, i.e. dequantized, where re-reading a
few rows still beats a float copy). A prefill graph's matmuls have a row per prompt token and stay
``mm``. Nothing per architecture: any 2-D matmul qualifies. Other lowerings and devices are left
alone (logged): the eager lowering would materialize the ``[rows, out, in]`` product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from dscompile.graph import node_value
from dscompile.pipeline import PassContext, register_pass

aten = torch.ops.aten


@dataclass
class DecodeGemvOptions:
    """Row limits: ``max_rows`` for a float weight read as it is, ``max_rows_packed`` for one the graph computes."""

    max_rows: int = 2  # at batch 8 a float weight's reductions were slower than mm (64.7 against 62.6 ms a decode step)
    max_rows_packed: int = 8


def _is_stored(node: torch.fx.Node) -> bool:
    """Whether the weight operand is a graph input seen through views (a float weight read as stored)."""
    while node.op == "call_function" and node.target in (aten.permute.default, aten.t.default, aten.view.default, aten.reshape.default):
        node = node.args[0]  # type: ignore[assignment]
    return node.op == "placeholder"


def _operands(node: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node, torch.fx.Node] | None:
    """``(bias, x, w_t)`` of an ``mm`` or a plain ``addmm`` (alpha = beta = 1), else None."""
    if node.target is aten.mm.default:
        return None, node.args[0], node.args[1]  # type: ignore[return-value]
    if node.target is aten.addmm.default and node.kwargs.get("alpha", 1) == 1 and node.kwargs.get("beta", 1) == 1:
        return node.args[0], node.args[1], node.args[2]  # type: ignore[return-value]
    return None


def _call(graph: torch.fx.Graph, like: torch.fx.Node, target: Any, *args: Any) -> torch.fx.Node:
    """A new node with its fake value (Inductor's graph passes read ``meta["val"]``) and ``like``'s source info."""
    node = graph.call_function(target, args)
    values = [node_value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    mode = next(v.fake_mode for v in values if isinstance(v, FakeTensor))
    with mode:
        node.meta["val"] = target(*values)
    node.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    return node


@register_pass("decode_gemv", graphs=("forward",), options=DecodeGemvOptions)
def decode_gemv(gm: torch.fx.GraphModule, ctx: PassContext, options: DecodeGemvOptions) -> torch.fx.GraphModule:
    log = ctx.logger("decode_gemv")
    if not ctx.is_inference:
        log.info("%s: not an inference graph (gradients on): matmuls left to mm", ctx.graph_name)
        return gm
    if ctx.analysis.get("lowering") != "inductor":
        log.info("%s: lowering %s, not inductor: matmuls left to mm", ctx.graph_name, ctx.analysis.get("lowering"))
        return gm
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        found = _operands(node)
        if found is None:
            continue
        bias, x, w_t = found
        xv, wv = node_value(x), node_value(w_t)
        if not (isinstance(xv, FakeTensor) and isinstance(wv, FakeTensor)) or xv.device.type != "cpu" or not xv.dtype.is_floating_point:
            continue
        limit = options.max_rows if _is_stored(w_t) else options.max_rows_packed
        if xv.dim() != 2 or xv.shape[0] > limit:
            continue
        with graph.inserting_before(node):
            rows = _call(graph, node, aten.unsqueeze.default, x, 1)  # [M, 1, K]
            weight = _call(graph, node, aten.unsqueeze.default, _call(graph, node, aten.permute.default, w_t, [1, 0]), 0)  # [1, N, K]
            out = _call(graph, node, aten.sum.dim_IntList, _call(graph, node, aten.mul.Tensor, rows, weight), [-1])
            if bias is not None:
                out = _call(graph, node, aten.add.Tensor, out, bias)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
        log.info(
            "%s: %d matmuls as weight-streaming reductions (at most %d rows, %d for a weight computed in the graph)",
            ctx.graph_name,
            rewritten,
            options.max_rows,
            options.max_rows_packed,
        )
    return gm

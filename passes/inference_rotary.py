"""Rotary position embedding found in the captured graph and replaced by one fused function per application.

DeepSpeed-Inference applies rotary embeddings inside its per-architecture attention kernels. Here
``fuse_rotary_embedding`` (pre-autograd graph, inference only) finds the rotate-half form from the
graph's structure, with nothing per architecture:

    out = x * cos + cat(-x[..., h:], x[..., :h], dim=-1) * sin        (h = half of x's last dim)

in any operand order of the products and the sum, the slices written as indexing or ``narrow``,
torch-level or ATen spellings. Partial rotary (GPT-NeoX, Phi: ``x_rot = X[..., :d]``, the result
concatenated back with ``X[..., d:]``) becomes one application on ``X`` with ``rotary_dim = d``.
Each match becomes one ``call_function`` of ``dscompile.kernels.rotary.rotary_embedding`` (the
same numbers, written per half with no rotated copy), so the dump shows one node per application
and AOTAutograd inlines its few pointwise ops for the lowering to compile as one kernel (Inductor
on CPU). In graphs on CUDA it becomes the ``dscompile::rotary_embedding`` op instead
(``dscompile.runtime.inference.ops``): the hand-written Triton kernel, the same bits. Graphs with
no rotary embedding (GPT-2, OPT) are left unchanged. The replaced nodes are left to the pipeline's ``dce`` (which keeps in-place writes such as the KV cache's).
Nodes created carry ``meta["dscompile"]["inference_fusion"] = {"rotary": [replaced node names]}``;
the count goes to ``ctx.analysis["inference_rotary"][graph]``.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dscompile.graph import ds_meta, node_value, set_fake_value
from dscompile.kernels.rotary import rotary_embedding
from dscompile.kernels.triton_dispatch import resolve_impl
from dscompile.pipeline import PassContext, register_pass
from dscompile.runtime.inference.ops import ROTARY_EMBEDDING

log = logging.getLogger("dscompile.passes.inference_rotary")

aten = torch.ops.aten
ADDS = {operator.add, torch.add, aten.add.Tensor}
MULS = {operator.mul, torch.mul, aten.mul.Tensor}
NEGS = {operator.neg, torch.neg, aten.neg.default}
CATS = {torch.cat, torch.concat, aten.cat.default}


def _call(node: Any, funcs: set, method: str) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    return (node.op == "call_function" and node.target in funcs) or (node.op == "call_method" and node.target == method)


def _shape(node: Any) -> tuple | None:
    value = node_value(node) if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _binary(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """The two operands of an add/mul with no ``alpha``."""
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    return node.args[0], node.args[1]


def last_dim_slice(node: Any) -> tuple[torch.fx.Node, int, int] | None:
    """``(source, start, stop)`` when ``node`` is ``source[..., start:stop]`` along the last dim (static bounds)."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    src = node.args[0] if node.args else None
    shape = _shape(src)
    if shape is None or not shape or not isinstance(shape[-1], int):
        return None
    size, ndim = shape[-1], len(shape)
    if node.target is operator.getitem:
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
            return None
        lead = index[:-1]
        full = slice(None, None, None)
        if not (lead == (Ellipsis,) or (len(lead) == ndim - 1 and all(i == full for i in lead))):
            return None
        start, stop = index[-1].start, index[-1].stop
    elif node.target == aten.slice.Tensor or (node.op == "call_method" and node.target == "narrow") or node.target is torch.narrow:
        args = list(node.args) + [None] * 5
        dim = args[1]
        if node.target == aten.slice.Tensor:
            start, stop = args[2], args[3]
            if args[4] not in (None, 1):
                return None
        else:
            start, length = args[2], args[3]
            if not (isinstance(start, int) and isinstance(length, int)):
                return None
            stop = start + length
        if dim not in (-1, ndim - 1):
            return None
    else:
        return None
    if not all(isinstance(b, (int, type(None))) for b in (start, stop)):
        return None
    start, stop, _ = slice(start, stop).indices(size)
    return src, start, stop


def _rotate_half_of(node: Any) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``cat((-x[..., h:], x[..., :h]), dim=-1)`` with ``h`` half of x's last dim."""
    if not _call(node, CATS, "cat") or node.op == "call_method":
        return None
    parts = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    shape = _shape(node)
    if shape is None or dim not in (-1, len(shape) - 1) or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    neg, first = parts
    if not _call(neg, NEGS, "neg"):
        return None
    second, first = last_dim_slice(neg.args[0]), last_dim_slice(first)
    if second is None or first is None or second[0] is not first[0]:
        return None
    x = first[0]
    size = _shape(x)[-1]  # type: ignore[index]
    half = size // 2
    if size % 2 or first[1:] != (0, half) or second[1:] != (half, size):
        return None
    return x


def match_rotary(add: torch.fx.Node) -> tuple[torch.fx.Node, Any, Any, list[torch.fx.Node]] | None:
    """``(x, cos, sin, nodes)`` when ``add`` computes ``x * cos + rotate_half(x) * sin``."""
    if not _call(add, ADDS, "add") or add.op == "call_method":
        return None
    operands = _binary(add)
    if operands is None or not all(_call(m, MULS, "mul") and m.op == "call_function" for m in operands):
        return None
    for plain, rotated in (operands, operands[::-1]):
        plain_ops, rotated_ops = _binary(plain), _binary(rotated)
        if plain_ops is None or rotated_ops is None:
            continue
        for cat, sin in (rotated_ops, rotated_ops[::-1]):
            x = _rotate_half_of(cat)
            if x is None:
                continue
            for a, cos in (plain_ops, plain_ops[::-1]):
                if a is not x or not _fits(x, cos) or not _fits(x, sin) or not _same_shape(_shape(add), _shape(x)):
                    continue
                return x, cos, sin, [plain, rotated, cat]
    return None


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
    """Equal shapes, symbolic sizes compared without adding guards."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(x == y if isinstance(x, int) and isinstance(y, int) else bool(statically_known_true(x == y)) for x, y in zip(a, b))


def _fits(x: torch.fx.Node, table: Any) -> bool:
    """``cos``/``sin`` as the rotary table: a tensor with x's last-dim size (broadcast over the rest)."""
    shape = _shape(table)
    return shape is not None and len(shape) >= 1 and shape[-1] == _shape(x)[-1]  # type: ignore[index]


def _partial(add: torch.fx.Node, x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, int] | None:
    """``(whole, cat, d)`` when ``x = whole[..., :d]`` and the result's one use is ``cat([result, whole[..., d:]], -1)``."""
    rot = last_dim_slice(x)
    if rot is None or rot[1] != 0 or len(add.users) != 1:
        return None
    whole, _, d = rot
    cat = next(iter(add.users))
    if not _call(cat, CATS, "cat") or cat.op == "call_method":
        return None
    parts = cat.args[0]
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or parts[0] is not add or dim not in (-1, len(_shape(cat) or ()) - 1):
        return None
    rest = last_dim_slice(parts[1])
    size = _shape(whole)[-1]  # type: ignore[index]
    if rest is None or rest[0] is not whole or rest[1:] != (d, size):
        return None
    return whole, cat, d


def fused_rotary(x: torch.fx.Node) -> Any:
    """What a match becomes: the Triton op on CUDA (when triton imports), the plain function elsewhere (Inductor fuses it)."""
    value = node_value(x)
    device = value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    return ROTARY_EMBEDDING if resolve_impl("auto", device) == "triton" else rotary_embedding


def _replace(gm: torch.fx.GraphModule, add: torch.fx.Node, x: torch.fx.Node, cos: Any, sin: Any, replaced: list[torch.fx.Node]) -> None:
    target, args = add, (x, cos, sin)
    partial = _partial(add, x)
    if partial is not None:
        whole, target, d = partial
        args = (whole, cos, sin, d)
    with gm.graph.inserting_before(target):
        fused = gm.graph.call_function(fused_rotary(x), args)
    set_fake_value(fused)
    for field in ("nn_module_stack", "stack_trace"):
        if field in add.meta:
            fused.meta[field] = add.meta[field]
    ds_meta(fused)["inference_fusion"] = {"rotary": [n.name for n in (*replaced, add, *([target] if target is not add else []))]}
    target.replace_all_uses_with(fused)


@register_pass("fuse_rotary_embedding", graphs=("pre_autograd",))
def fuse_rotary_embedding(gm: torch.fx.GraphModule, ctx: PassContext, options: None) -> torch.fx.GraphModule:
    """``x * cos + rotate_half(x) * sin`` (and its partial form) becomes one fused rotary call per application (inference only)."""
    if torch.is_grad_enabled():
        log.info("%s: gradients are on; rotary embeddings are fused for inference graphs only", ctx.graph_name)
        return gm
    matches = [(node, m) for node in list(gm.graph.nodes) if (m := match_rotary(node)) is not None]
    for add, (x, cos, sin, replaced) in matches:
        _replace(gm, add, x, cos, sin, replaced)
    gm.graph.lint()
    gm.recompile()
    ctx.analysis.setdefault("inference_rotary", {})[ctx.graph_name] = len(matches)
    log.info("%s: %d rotary embeddings fused", ctx.graph_name, len(matches))
    return gm

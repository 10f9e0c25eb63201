"""The graph facts tensor and sequence parallelism both propagate shardings with: which aten ops act elementwise,
view or reduce, a node's static shape, and how a view groups its dimensions.

``blocks.py``/``propagate.py`` slice weights along them; ``sequence.py`` slices the sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

SECTION = "tensor_parallel"  # the config section both read


def node_shape(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


POINTWISE = {
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.neg.default, aten.sigmoid.default,
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.pow.Tensor_Scalar, aten.masked_fill.Scalar,
    aten.where.self, aten.dropout.default, aten.clone.default, aten.contiguous.default, aten._to_copy.default,
    aten.to.dtype, aten.type_as.default, aten.alias.default, aten.mul.Scalar, aten.add.Scalar, aten.div.Scalar,
    aten.rsqrt.default, aten.exp.default, aten.erf.default,
}  # fmt: skip
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# reductions over listed dims (Qwen3's RMSNorm of each head over its head_dim): whole on the slice if the sliced dim is not one of them
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction}


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """A view's dims in groups of equal products (``[B, S, H] -> [B*S, H]``: ``([0, 1], [0]), ([2], [1])``)."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                a *= src[i]
                gi.append(i)
                i += 1
            elif b < a and j < len(dst):
                b *= dst[j]
                gj.append(j)
                j += 1
            else:
                return []
        groups.append((gi, gj))
    return groups


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def attr_value(module: Any, target: str) -> Any:
    """What a ``get_attr`` target (a dotted name) holds in ``module``: a parameter, buffer or submodule."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value

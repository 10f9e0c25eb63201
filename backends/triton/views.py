"""Where a view reads its source: each view op as index arithmetic, so views cost no loads of their own."""

from __future__ import annotations

import sympy
import torch
import torch.fx

from dscompile.backends.triton.index import broadcast_index, reshape_index
from dscompile.backends.triton.specs import CodegenUnsupported

aten = torch.ops.aten


def view_source_index(node: torch.fx.Node, index: tuple, ranges: dict) -> tuple:
    """The index into a view's source of the element the view has at ``index``."""
    target = node.target
    src_shape = tuple(node.args[0].meta["val"].shape)
    out_shape = tuple(node.meta["val"].shape)
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return reshape_index(index, out_shape, src_shape, ranges)
    if target == aten.expand.default:
        return broadcast_index(index, out_shape, src_shape)
    if target == aten.alias.default:
        return index
    if target == aten.unsqueeze.default:
        d = node.args[1] % len(out_shape)
        return index[:d] + index[d + 1 :]
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        if target == aten.squeeze.default:
            dims = [i for i, s in enumerate(src_shape) if s == 1]
        else:
            raw = node.args[1]
            raw = [raw] if isinstance(raw, int) else list(raw)
            dims = [d % max(len(src_shape), 1) for d in raw if src_shape and src_shape[d % len(src_shape)] == 1]
        it = iter(index)
        return tuple(sympy.Integer(0) if i in dims else next(it) for i in range(len(src_shape)))
    if target in (aten.permute.default, aten.t.default, aten.transpose.int):
        n = len(src_shape)
        if target == aten.permute.default:
            perm = [d % n for d in node.args[1]]
        else:
            perm = list(range(n))
            d0, d1 = (0, 1) if target == aten.t.default else (node.args[1] % n, node.args[2] % n)
            if n >= 2:
                perm[d0], perm[d1] = perm[d1], perm[d0]
        result = [sympy.Integer(0)] * n
        for k, p in enumerate(perm):
            result[p] = index[k]
        return tuple(result)
    if target == aten.slice.Tensor:
        n = len(src_shape)
        dim = (node.args[1] if len(node.args) > 1 else 0) % n
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        start = 0 if start is None else start
        if start < 0:
            start += src_shape[dim]
        start = min(max(start, 0), src_shape[dim])
        return index[:dim] + (sympy.Integer(start) + sympy.Integer(step) * index[dim],) + index[dim + 1 :]
    if target == aten.select.int:
        n = len(src_shape)
        dim = node.args[1] % n
        pos = node.args[2] % src_shape[dim]
        return index[:dim] + (sympy.Integer(pos),) + index[dim:]
    raise CodegenUnsupported(f"no index rule for view {target}")

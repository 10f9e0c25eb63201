"""The aten ops the Triton codegen has rules for, grouped by how they are generated, and a reduction's dims.

The tables hold the Triton source templates of the simple pointwise ops; ``support.py`` decides from them
which nodes a region may take, and the emitter and ``pointwise.py`` print from them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

aten = torch.ops.aten
prims = torch.ops.prims


VIEW_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.permute.default,
    aten.t.default,
    aten.transpose.int,
    aten.slice.Tensor,
    aten.select.int,
    aten.alias.default,
}

IDENTITY_OPS = {aten.clone.default, aten.lift_fresh_copy.default, aten.detach.default}

CAST_OPS = {prims.convert_element_type.default, aten._to_copy.default}

REDUCTION_OPS = {
    aten.sum.dim_IntList: "sum",
    aten.sum.default: "sum",
    aten.mean.dim: "mean",
    aten.mean.default: "mean",
    aten.amax.default: "max",
    aten.amin.default: "min",
}

# Unary float ops: template over the compute-dtype operand.
UNARY_FLOAT = {
    aten.exp.default: "tl.exp({0})",
    aten.exp2.default: "tl.exp2({0})",
    aten.log.default: "tl.log({0})",
    aten.log2.default: "tl.log2({0})",
    aten.sqrt.default: "tl.sqrt({0})",
    aten.rsqrt.default: "tl.rsqrt({0})",
    aten.sin.default: "tl.sin({0})",
    aten.cos.default: "tl.cos({0})",
    aten.erf.default: "tl.erf({0})",
    aten.sigmoid.default: "tl.sigmoid({0})",
    aten.tanh.default: "_ds_tanh({0})",
    aten.log1p.default: "_ds_log1p({0})",
    aten.expm1.default: "_ds_expm1({0})",
    aten.reciprocal.default: "(1.0 / {0})",
    aten.floor.default: "tl.floor({0})",
    aten.ceil.default: "tl.ceil({0})",
    aten.silu.default: "({0} * tl.sigmoid({0}))",
}

# Ops computed in the result dtype (or the promoted input dtype for comparisons).
ARITH = {
    aten.add.Tensor: "({0} + {1})",
    aten.add.Scalar: "({0} + {1})",
    aten.sub.Tensor: "({0} - {1})",
    aten.sub.Scalar: "({0} - {1})",
    aten.mul.Tensor: "({0} * {1})",
    aten.mul.Scalar: "({0} * {1})",
    aten.div.Tensor: "({0} / {1})",
    aten.div.Scalar: "({0} / {1})",
    aten.neg.default: "(-{0})",
    aten.abs.default: "tl.abs({0})",
    aten.relu.default: "tl.where({0} != {0}, {0}, tl.maximum({0}, 0))",
    aten.maximum.default: "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    aten.minimum.default: "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    aten.sign.default: "tl.where({0} > 0, 1, tl.where({0} < 0, -1, 0))",
}

COMPARE = {
    aten.eq.Tensor: "==",
    aten.eq.Scalar: "==",
    aten.ne.Tensor: "!=",
    aten.ne.Scalar: "!=",
    aten.lt.Tensor: "<",
    aten.lt.Scalar: "<",
    aten.le.Tensor: "<=",
    aten.le.Scalar: "<=",
    aten.gt.Tensor: ">",
    aten.gt.Scalar: ">",
    aten.ge.Tensor: ">=",
    aten.ge.Scalar: ">=",
}

LOGICAL = {
    aten.logical_not.default: "({0} == 0)",
    aten.bitwise_not.default: "({0} == 0)",
    aten.logical_and.default: "(({0} != 0) & ({1} != 0))",
    aten.logical_or.default: "(({0} != 0) | ({1} != 0))",
}

FILL_OPS = {
    aten.full.default,
    aten.scalar_tensor.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
}

_OTHER_POINTWISE = {
    aten.where.self,
    aten.masked_fill.Scalar,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.pow.Tensor_Scalar,
    aten.gelu.default,
    aten.full.default,
    aten.scalar_tensor.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.div.Tensor_mode,
}

POINTWISE_OPS = set(UNARY_FLOAT) | set(ARITH) | set(COMPARE) | set(LOGICAL) | _OTHER_POINTWISE | IDENTITY_OPS | CAST_OPS
SUPPORTED_OPS = POINTWISE_OPS | VIEW_OPS | set(REDUCTION_OPS)


def is_fma(target: Any) -> bool:
    # prims.fma exists only once Inductor's decompositions are imported, so match it by name.
    return str(target) == "prims.fma.default"


def reduction_dims(node: torch.fx.Node) -> list[int] | None:
    """The dims a reduction node reduces (normalised, sorted), or None for all dims."""
    val = node.args[0].meta["val"]
    ndim = val.dim()
    if node.target in (aten.sum.default, aten.mean.default):
        return list(range(ndim))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(ndim, 1) for d in dims})


def keepdim(node: torch.fx.Node) -> bool:
    if node.target in (aten.sum.default, aten.mean.default):
        return False
    if len(node.args) > 2:
        return bool(node.args[2])
    return bool(node.kwargs.get("keepdim", False))

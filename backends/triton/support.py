"""Which nodes the Triton codegen can take into a region, and why not.

The ``fuse`` pass asks before it groups nodes, and ``generate_kernel`` asks again for every node of a region;
a reason (never a silent skip) is what the dump and the logs show for a node left to aten.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dscompile.backends.triton.ops import IDENTITY_OPS, REDUCTION_OPS, SUPPORTED_OPS, VIEW_OPS, is_fma, reduction_dims
from dscompile.backends.triton.specs import TL_DTYPES

aten = torch.ops.aten


def _static_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape) and all(
        isinstance(s, int) for s in value.stride()
    )


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """Why the Triton codegen cannot take ``node`` into a region (None when it can)."""
    from dscompile.graph import is_collective, op_name

    if node.op != "call_function":
        return None if node.op in ("placeholder", "output", "get_attr") else f"{node.op} is not generated"
    if is_collective(node):
        return "collective: kept as a call so its overlap is preserved"
    if node.meta.get("dscompile", {}).get("kernel") == "matmul_epilogue":
        return "matmul + epilogue: runs as the Triton matmul template"
    target = node.target
    name = op_name(node)
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default):
        return f"{name}: matmul/convolution stays a library call"
    if target not in SUPPORTED_OPS and not is_fma(target):
        return f"{name}: no Triton codegen rule for this op"
    val = node.meta.get("val")
    if not _static_tensor(val):
        return f"{name}: output is not a statically shaped tensor (dynamic shapes fall back to aten)"
    if val.numel() == 0:
        return f"{name}: empty tensor"
    if val.dtype not in TL_DTYPES:
        return f"{name}: dtype {val.dtype} not generated"
    for arg in node.all_input_nodes:
        aval = arg.meta.get("val")
        if not _static_tensor(aval):
            return f"{name}: input {arg.name} is not a statically shaped tensor"
        if aval.dtype not in TL_DTYPES:
            return f"{name}: input dtype {aval.dtype} not generated"
    if target in REDUCTION_OPS:
        dims = reduction_dims(node)
        ndim = node.args[0].meta["val"].dim()
        if dims != list(range(ndim - len(dims), ndim)):
            return f"{name}: reduces dims {dims}, only trailing dims are generated"
        if REDUCTION_OPS[target] in ("max", "min") and not val.dtype.is_floating_point:
            return f"{name}: integer max/min reductions are not generated"
        dtype_kw = node.kwargs.get("dtype")
        if dtype_kw is not None and dtype_kw != val.dtype:
            return f"{name}: reduction with a dtype argument"
    if target == aten._to_copy.default:
        extra = set(node.kwargs) - {"dtype", "layout", "device", "memory_format"}
        if extra or node.kwargs.get("device") not in (None, val.device):
            return f"{name}: copy changes more than the dtype"
    if target == aten.pow.Tensor_Scalar and not isinstance(node.args[1], (int, float)):
        return f"{name}: non-numeric exponent"
    if target == aten.div.Tensor_mode and node.kwargs.get("rounding_mode") is not None and not val.dtype.is_floating_point:
        return f"{name}: integer division with rounding is not generated"
    if target in (aten.add.Tensor, aten.sub.Tensor) and node.kwargs.get("alpha", 1) != 1 and not val.dtype.is_floating_point:
        return f"{name}: integer alpha"
    return None


def is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS


def is_compute(node: torch.fx.Node) -> bool:
    """A node that does arithmetic (as opposed to a free view or identity)."""
    if node.op != "call_function":
        return False
    return is_fma(node.target) or (node.target in SUPPORTED_OPS and node.target not in VIEW_OPS | IDENTITY_OPS)

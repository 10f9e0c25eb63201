"""Triton source for one pointwise op at one index, from its operands' generated values.

Float math runs in fp32 (fp64 stays fp64) and is cast back to the op's dtype, as eager computes each op;
comparisons compute in their operands' promoted type. The emitter calls ``emit_pointwise`` for every
pointwise node it reaches and owns the values it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from dscompile.backends.triton.ops import ARITH, CAST_OPS, COMPARE, FILL_OPS, LOGICAL, UNARY_FLOAT, is_fma
from dscompile.backends.triton.specs import CodegenUnsupported, Value, cast, compute_float, literal, tl_dtype

if TYPE_CHECKING:
    from dscompile.backends.triton.emitter import RegionEmitter

aten = torch.ops.aten


def emit_pointwise(em: RegionEmitter, node: torch.fx.Node, args: list, dtype: torch.dtype, rdep: bool) -> Value:
    """Generate ``node`` (a pointwise op, not an identity) from its operands' values ``args``."""
    target = node.target
    if target in CAST_OPS:
        return em.new(cast(args[0], dtype), dtype, rdep)
    if target in UNARY_FLOAT:
        cdt = compute_float(dtype)
        code = UNARY_FLOAT[target].format(cast(args[0], cdt))
        return em.new(f"({code}).to({tl_dtype(dtype)})", dtype, rdep)
    if target in ARITH:
        cdt = compute_float(dtype) if dtype.is_floating_point else dtype
        operands = [cast(a, cdt) for a in args[:3]]
        code = ARITH[target].format(*operands)
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            op = "+" if target == aten.add.Tensor else "-"
            code = f"({operands[0]} {op} {operands[1]} * {literal(alpha)})"
        return em.new(f"({code}).to({tl_dtype(dtype)})", dtype, rdep)
    if is_fma(target):
        cdt = compute_float(dtype) if dtype.is_floating_point else dtype
        a, b, c = (cast(x, cdt) for x in args[:3])
        return em.new(f"({a} * {b} + {c}).to({tl_dtype(dtype)})", dtype, rdep)
    if target in COMPARE:
        cdt = promoted(args)
        a, b = (cast(x, cdt) for x in args[:2])
        return em.new(f"{a} {COMPARE[target]} {b}", torch.bool, rdep)
    if target in LOGICAL:
        operands = [cast(a, a.dtype) if isinstance(a, Value) else literal(a) for a in args]
        return em.new(LOGICAL[target].format(*operands), torch.bool, rdep)
    return _emit_other(em, node, args, dtype, rdep)


def promoted(args: Sequence[Any]) -> torch.dtype:
    """The dtype a comparison computes in (its operands' promoted type)."""
    dtypes = [a.dtype for a in args if isinstance(a, Value)]
    if any(d == torch.float64 for d in dtypes):
        return torch.float64
    if any(d.is_floating_point for d in dtypes) or any(isinstance(a, float) for a in args):
        return torch.float32
    if all(d == torch.bool for d in dtypes) and not any(isinstance(a, int) and not isinstance(a, bool) for a in args):
        return torch.bool
    return torch.int64


def _emit_other(em: RegionEmitter, node: torch.fx.Node, args: list, dtype: torch.dtype, rdep: bool) -> Value:
    target = node.target
    out = tl_dtype(dtype)
    cdt = compute_float(dtype) if dtype.is_floating_point else dtype
    if target == aten.where.self:
        c = cast(args[0], torch.bool)
        a, b = cast(args[1], cdt), cast(args[2], cdt)
        return em.new(f"tl.where({c}, {a}, {b}).to({out})", dtype, rdep)
    if target == aten.masked_fill.Scalar:
        c = cast(args[1], torch.bool)
        return em.new(f"tl.where({c}, {literal(args[2])}, {cast(args[0], cdt)}).to({out})", dtype, rdep)
    if target in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        x = cast(args[0], cdt)
        lo = args[1] if target != aten.clamp_max.default else None
        if target == aten.clamp_max.default:
            hi = args[1]
        else:
            hi = args[2] if target == aten.clamp.default and len(args) > 2 else None
        if target == aten.clamp.default:
            lo = node.kwargs.get("min", lo)
            hi = node.kwargs.get("max", hi)
        if lo is not None:
            x = f"tl.maximum({x}, {literal(lo)}, propagate_nan=tl.PropagateNan.ALL)"
        if hi is not None:
            x = f"tl.minimum({x}, {literal(hi)}, propagate_nan=tl.PropagateNan.ALL)"
        return em.new(f"({x}).to({out})", dtype, rdep)
    if target == aten.pow.Tensor_Scalar:
        x = cast(args[0], cdt)
        e = args[1]
        if float(e) == int(e) and abs(int(e)) <= 8:
            n = int(e)
            if n == 0:
                code = f"({x} * 0 + 1)"
            else:
                code = "(" + " * ".join([x] * abs(n)) + ")"
                if n < 0:
                    code = f"(1.0 / {code})"
        elif e == 0.5:
            code = f"tl.sqrt({x})"
        elif e == -0.5:
            code = f"tl.rsqrt({x})"
        else:
            code = f"tl.exp2({literal(float(e))} * tl.log2({x}))"
        return em.new(f"({code}).to({out})", dtype, rdep)
    if target == aten.gelu.default:
        x = cast(args[0], cdt)
        approximate = node.kwargs.get("approximate", args[1] if len(args) > 1 else "none")
        if approximate == "tanh":
            code = f"0.5 * {x} * (1.0 + _ds_tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))"
        else:
            code = f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"
        return em.new(f"({code}).to({out})", dtype, rdep)
    if target == aten.div.Tensor_mode:
        a, b = cast(args[0], cdt), cast(args[1], cdt)
        mode = node.kwargs.get("rounding_mode")
        code = f"({a} / {b})"
        if mode == "floor":
            code = f"tl.floor({code})"
        elif mode == "trunc":
            code = f"tl.where({code} < 0, tl.ceil({code}), tl.floor({code}))"
        return em.new(f"({code}).to({out})", dtype, rdep)
    if target in FILL_OPS:
        if target == aten.full.default:
            fill = args[1]
        elif target == aten.scalar_tensor.default:
            fill = args[0]
        elif target == aten.full_like.default:
            fill = args[1]
        else:
            fill = 0 if target == aten.zeros_like.default else 1
        if dtype == torch.bool:
            fill = bool(fill)
        return em.new(f"tl.full({em.shape_tile()}, {literal(fill)}, {out})", dtype, False)
    raise CodegenUnsupported(f"no emitter for {target}")

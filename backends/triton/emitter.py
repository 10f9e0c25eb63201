"""Generate one Triton kernel's source for a fused region of aten ops (no triton import here).

A region is a set of pointwise ops, free views and reductions over trailing dims. The kernel
walks an iteration space (the reduction's input shape, or the largest output's shape); every
value is generated on demand at an index expressed with sympy in the space's dim symbols, so
broadcasts, views, permutes and slices become index arithmetic. Index expressions are
simplified with the dims' known ranges, adjacent dims that every access walks contiguously are
merged, and the result is printed as Triton code. The planner raises ``CodegenUnsupported``
with a reason for anything it cannot express; callers fall back to aten for that region.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx

aten = torch.ops.aten
prims = torch.ops.prims

# Largest reduction width a single-pass kernel keeps in one tile.
MAX_RBLOCK = 65536


class CodegenUnsupported(Exception):
    """The region (or node) cannot be generated; the message says why."""


# ----------------------------------------------------------------------------------------------
# Index algebra


class FloorDiv(sympy.Function):
    """Integer floor division of a non-negative index by a positive constant (printed ``//``)."""

    nargs = 2
    is_integer = True


class ModIndex(sympy.Function):
    """Remainder of a non-negative index by a positive constant (printed ``%``)."""

    nargs = 2
    is_integer = True


def bounds(expr: sympy.Expr, ranges: dict[sympy.Symbol, tuple[int, int]]) -> tuple[int, int]:
    """Inclusive integer bounds of an index expression given its symbols' ranges."""
    if expr.is_Integer:
        return int(expr), int(expr)
    if expr.is_Symbol:
        return ranges[expr]
    if expr.is_Add:
        lo = hi = 0
        for term in expr.args:
            a, b = bounds(term, ranges)
            lo, hi = lo + a, hi + b
        return lo, hi
    if expr.is_Mul:
        lo, hi = 1, 1
        for factor in expr.args:
            a, b = bounds(factor, ranges)
            products = (lo * a, lo * b, hi * a, hi * b)
            lo, hi = min(products), max(products)
        return lo, hi
    if isinstance(expr, FloorDiv):
        a, b = bounds(expr.args[0], ranges)
        c = int(expr.args[1])
        return a // c, b // c
    if isinstance(expr, ModIndex):
        a, b = bounds(expr.args[0], ranges)
        c = int(expr.args[1])
        return (a, b) if 0 <= a and b < c else (0, c - 1)
    raise CodegenUnsupported(f"cannot bound index expression {expr}")


def _split_by_divisor(expr: sympy.Expr, c: int) -> tuple[sympy.Expr, sympy.Expr]:
    """Split ``expr`` into (terms whose coefficient is a multiple of c, divided by c; the rest)."""
    whole, rest = [], []
    for term in sympy.Add.make_args(sympy.expand(expr)):
        coeff, rest_part = term.as_coeff_Mul()
        if coeff.is_Integer and int(coeff) % c == 0:
            whole.append(sympy.Integer(int(coeff) // c) * rest_part)
        else:
            rest.append(term)
    return sympy.Add(*whole), sympy.Add(*rest)


def floordiv(expr: sympy.Expr, c: int, ranges: dict) -> sympy.Expr:
    if c == 1:
        return expr
    whole, rest = _split_by_divisor(expr, c)
    lo, hi = bounds(rest, ranges)
    if lo >= 0 and hi < c:
        return whole
    return whole + FloorDiv(rest, c)


def modulo(expr: sympy.Expr, c: int, ranges: dict) -> sympy.Expr:
    if c == 1:
        return sympy.Integer(0)
    _, rest = _split_by_divisor(expr, c)
    lo, hi = bounds(rest, ranges)
    if lo >= 0 and hi < c:
        return rest
    return ModIndex(rest, c)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return list(reversed(strides))


def reshape_index(index: Sequence[sympy.Expr], src: Sequence[int], dst: Sequence[int], ranges: dict) -> tuple:
    """Index into ``dst`` of the element that sits at ``index`` of ``src`` (row-major reshape)."""
    linear = sum((e * s for e, s in zip(index, contiguous_strides(src), strict=False)), sympy.Integer(0))
    return tuple(modulo(floordiv(linear, s, ranges), size, ranges) for s, size in zip(contiguous_strides(dst), dst, strict=False))


def broadcast_index(index: Sequence[sympy.Expr], out_shape: Sequence[int], in_shape: Sequence[int]) -> tuple:
    """Index into an input that broadcasts (right-aligned) to ``out_shape``."""
    offset = len(out_shape) - len(in_shape)
    if offset < 0:
        raise CodegenUnsupported(f"shape {list(in_shape)} does not broadcast to {list(out_shape)}")
    result = []
    for j, size in enumerate(in_shape):
        if size == 1:
            result.append(sympy.Integer(0))
        elif size == out_shape[j + offset]:
            result.append(index[j + offset])
        else:
            raise CodegenUnsupported(f"shape {list(in_shape)} does not broadcast to {list(out_shape)}")
    return tuple(result)


def print_index(expr: sympy.Expr) -> str:
    """Triton source for an index expression."""
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return expr.name
    if expr.is_Add:
        return "(" + " + ".join(print_index(a) for a in expr.args) + ")"
    if expr.is_Mul:
        return "*".join(f"({print_index(a)})" if a.is_Integer and int(a) < 0 else print_index(a) for a in expr.args)
    if isinstance(expr, FloorDiv):
        return f"({print_index(expr.args[0])} // {int(expr.args[1])})"
    if isinstance(expr, ModIndex):
        return f"({print_index(expr.args[0])} % {int(expr.args[1])})"
    raise CodegenUnsupported(f"cannot print index expression {expr}")


# ----------------------------------------------------------------------------------------------
# Tensors, dtypes and the op tables


@dataclass(frozen=True)
class TensorSpec:
    """What a kernel is specialised on for one tensor: shape, strides and dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), t.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}


def tl_dtype(dtype: torch.dtype) -> str:
    if dtype not in _TL_DTYPES:
        raise CodegenUnsupported(f"dtype {dtype} is not generated")
    return _TL_DTYPES[dtype]


def compute_float(dtype: torch.dtype) -> torch.dtype:
    """Half types compute in fp32 (as eager does per op); fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
_UNARY_FLOAT = {
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
_ARITH = {
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

_COMPARE = {
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

_LOGICAL = {
    aten.logical_not.default: "({0} == 0)",
    aten.bitwise_not.default: "({0} == 0)",
    aten.logical_and.default: "(({0} != 0) & ({1} != 0))",
    aten.logical_or.default: "(({0} != 0) | ({1} != 0))",
}

_FILL_OPS = {
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

POINTWISE_OPS = set(_UNARY_FLOAT) | set(_ARITH) | set(_COMPARE) | set(_LOGICAL) | _OTHER_POINTWISE | IDENTITY_OPS | CAST_OPS
SUPPORTED_OPS = POINTWISE_OPS | VIEW_OPS | set(REDUCTION_OPS)

_HELPERS = '''
@triton.jit
def _ds_tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _ds_log1p(x):
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _ds_expm1(x):
    u = tl.exp(x)
    return tl.where(u == 1.0, x, tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * (x / tl.log(u))))
'''


def _reduction_dims(node: torch.fx.Node) -> list[int] | None:
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


def _keepdim(node: torch.fx.Node) -> bool:
    if node.target in (aten.sum.default, aten.mean.default):
        return False
    if len(node.args) > 2:
        return bool(node.args[2])
    return bool(node.kwargs.get("keepdim", False))


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
    if target not in SUPPORTED_OPS and not _is_fma(target):
        return f"{name}: no Triton codegen rule for this op"
    val = node.meta.get("val")
    if not _static_tensor(val):
        return f"{name}: output is not a statically shaped tensor (dynamic shapes fall back to aten)"
    if val.numel() == 0:
        return f"{name}: empty tensor"
    if val.dtype not in _TL_DTYPES:
        return f"{name}: dtype {val.dtype} not generated"
    for arg in node.all_input_nodes:
        aval = arg.meta.get("val")
        if not _static_tensor(aval):
            return f"{name}: input {arg.name} is not a statically shaped tensor"
        if aval.dtype not in _TL_DTYPES:
            return f"{name}: input dtype {aval.dtype} not generated"
    if target in REDUCTION_OPS:
        dims = _reduction_dims(node)
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


def _is_fma(target: Any) -> bool:
    # prims.fma exists only once Inductor's decompositions are imported, so match it by name.
    return str(target) == "prims.fma.default"


def is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS


def is_compute(node: torch.fx.Node) -> bool:
    """A node that does arithmetic (as opposed to a free view or identity)."""
    if node.op != "call_function":
        return False
    return _is_fma(node.target) or (node.target in SUPPORTED_OPS and node.target not in VIEW_OPS | IDENTITY_OPS)


# ----------------------------------------------------------------------------------------------
# The planner / emitter


@dataclass
class _Value:
    name: str
    dtype: torch.dtype
    rdep: bool


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(value)
    if isinstance(value, int):
        return str(value)
    raise CodegenUnsupported(f"cannot embed constant {value!r}")


@dataclass
class KernelSource:
    """Generated source plus what the launcher needs to run it."""

    name: str
    source: str
    kind: str  # "pointwise" | "reduction"
    xnumel: int
    rnumel: int
    rblock: int
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]
    output_is_tuple: bool
    key: str
    index_int64: bool
    notes: list[str] = field(default_factory=list)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class RegionEmitter:
    """Walks one region on demand, collecting loads, computations, reductions and stores."""

    def __init__(
        self,
        inputs: Sequence[torch.fx.Node],
        nodes: Sequence[torch.fx.Node],
        outputs: Sequence[torch.fx.Node],
        input_specs: Sequence[TensorSpec],
        output_specs: Sequence[TensorSpec],
    ) -> None:
        self.inputs = list(inputs)
        self.nodes = list(nodes)
        self.outputs = list(outputs)
        self.input_pos = {n: i for i, n in enumerate(self.inputs)}
        self.node_set = set(self.nodes)
        self.input_specs = list(input_specs)
        self.output_specs = list(output_specs)
        self.lines: list[tuple[str, Any]] = []  # ("code", str) or ("load"/"store", ...) with sympy offsets
        self.memo: dict[tuple, _Value] = {}
        self.counter = 0
        self._choose_space()

    # -- iteration space
    def _choose_space(self) -> None:
        reductions = [n for n in self.nodes if n.target in REDUCTION_OPS]
        if reductions:
            spaces = set()
            for node in reductions:
                shape = tuple(node.args[0].meta["val"].shape)
                dims = _reduction_dims(node)
                spaces.add((shape, len(shape) - len(dims)))
            if len(spaces) != 1:
                raise CodegenUnsupported(f"reductions over different spaces {sorted(spaces)}")
            (shape, nrow), = spaces
            self.kind = "reduction"
        else:
            shape = max((tuple(n.meta["val"].shape) for n in self.outputs), key=math.prod)
            nrow = len(shape)
            self.kind = "pointwise"
        self.full_shape = tuple(shape)
        self.nrow = nrow
        self.syms = [sympy.Symbol(f"d{i}", integer=True, nonnegative=True) for i in range(len(shape))]
        self.ranges = {s: (0, size - 1) for s, size in zip(self.syms, shape, strict=False)}
        zero = {s: 0 for s, size in zip(self.syms, shape, strict=False) if size == 1}
        self.full_index = tuple(sympy.Integer(0) if s in zero else s for s in self.syms)
        self.row_index = self.full_index[:nrow]
        self.rsyms = set(self.syms[nrow:])
        self.xnumel = math.prod(shape[:nrow])
        self.rnumel = math.prod(shape[nrow:])

    def natural_index(self, shape: tuple[int, ...]) -> tuple:
        full = self.full_shape
        if shape == full:
            return self.full_index
        if self.kind == "reduction":
            rows = full[: self.nrow]
            if shape == rows:
                return self.row_index
            if shape == rows + (1,) * (len(full) - self.nrow):
                return self.row_index + (sympy.Integer(0),) * (len(full) - self.nrow)
        if math.prod(shape) == math.prod(full) and self.kind == "pointwise":
            return reshape_index(self.full_index, full, shape, self.ranges)
        try:
            return broadcast_index(self.full_index, full, shape)
        except CodegenUnsupported:
            if math.prod(shape) == math.prod(full):
                return reshape_index(self.full_index, full, shape, self.ranges)
            raise CodegenUnsupported(f"output shape {list(shape)} does not fit the iteration space {list(full)}") from None

    # -- emission helpers
    def _new(self, code: str, dtype: torch.dtype, rdep: bool) -> _Value:
        name = f"v{self.counter}"
        self.counter += 1
        self.lines.append(("code", f"{name} = {code}"))
        return _Value(name, dtype, rdep)

    def _cast(self, v: _Value | Any, dtype: torch.dtype) -> str:
        if not isinstance(v, _Value):
            return _literal(v)
        if v.dtype == dtype:
            return v.name
        if dtype == torch.bool:
            return f"({v.name} != 0)"
        return f"{v.name}.to({tl_dtype(dtype)})"

    def _depends_on_r(self, index: Sequence[sympy.Expr]) -> bool:
        return any(e.free_symbols & self.rsyms for e in index)

    # -- on-demand generation
    def value(self, node: Any, index: tuple) -> _Value | Any:
        if not isinstance(node, torch.fx.Node):
            return node
        key = (node, index)
        if key in self.memo:
            return self.memo[key]
        if node in self.input_pos:
            result = self._load(node, index)
        elif node in self.node_set:
            result = self._emit(node, index)
        else:
            raise CodegenUnsupported(f"{node.name} is neither an input nor in the region")
        self.memo[key] = result
        return result

    def _load(self, node: torch.fx.Node, index: tuple) -> _Value:
        spec = self.input_specs[self.input_pos[node]]
        if len(index) != len(spec.shape):
            raise CodegenUnsupported(f"rank mismatch loading {node.name}")
        offset = sum((e * s for e, s in zip(index, spec.stride, strict=False)), sympy.Integer(0))
        rdep = self._depends_on_r(index)
        name = f"v{self.counter}"
        self.counter += 1
        self.lines.append(("load", (name, self.input_pos[node], offset, rdep)))
        return _Value(name, spec.dtype, rdep)

    def _arg_index(self, arg: torch.fx.Node, out_shape: tuple, index: tuple) -> tuple:
        return broadcast_index(index, out_shape, tuple(arg.meta["val"].shape))

    def _emit(self, node: torch.fx.Node, index: tuple) -> _Value:
        target = node.target
        val = node.meta["val"]
        out_shape = tuple(val.shape)
        dtype = val.dtype
        if target in VIEW_OPS:
            src = node.args[0]
            return self.value(src, self._view_source_index(node, index))
        if target in REDUCTION_OPS:
            return self._reduce(node, index)
        args = [self.value(a, self._arg_index(a, out_shape, index)) if isinstance(a, torch.fx.Node) else a for a in node.args]
        rdep = any(isinstance(a, _Value) and a.rdep for a in args)
        if target in IDENTITY_OPS:
            return args[0]
        if target in CAST_OPS:
            return self._new(self._cast(args[0], dtype), dtype, rdep)
        if target in _UNARY_FLOAT:
            cdt = compute_float(dtype)
            code = _UNARY_FLOAT[target].format(self._cast(args[0], cdt))
            return self._new(f"({code}).to({tl_dtype(dtype)})", dtype, rdep)
        if target in _ARITH:
            cdt = compute_float(dtype) if dtype.is_floating_point else dtype
            operands = [self._cast(a, cdt) for a in args[:3]]
            code = _ARITH[target].format(*operands)
            alpha = node.kwargs.get("alpha", 1)
            if alpha != 1:
                op = "+" if target == aten.add.Tensor else "-"
                code = f"({operands[0]} {op} {operands[1]} * {_literal(alpha)})"
            return self._new(f"({code}).to({tl_dtype(dtype)})", dtype, rdep)
        if _is_fma(target):
            cdt = compute_float(dtype) if dtype.is_floating_point else dtype
            a, b, c = (self._cast(x, cdt) for x in args[:3])
            return self._new(f"({a} * {b} + {c}).to({tl_dtype(dtype)})", dtype, rdep)
        if target in _COMPARE:
            cdt = self._promoted(args)
            a, b = (self._cast(x, cdt) for x in args[:2])
            return self._new(f"{a} {_COMPARE[target]} {b}", torch.bool, rdep)
        if target in _LOGICAL:
            operands = [self._cast(a, a.dtype) if isinstance(a, _Value) else _literal(a) for a in args]
            return self._new(_LOGICAL[target].format(*operands), torch.bool, rdep)
        return self._emit_other(node, args, index, dtype, rdep)

    def _promoted(self, args: Sequence[Any]) -> torch.dtype:
        dtypes = [a.dtype for a in args if isinstance(a, _Value)]
        if any(d == torch.float64 for d in dtypes):
            return torch.float64
        if any(d.is_floating_point for d in dtypes) or any(isinstance(a, float) for a in args):
            return torch.float32
        if all(d == torch.bool for d in dtypes) and not any(isinstance(a, int) and not isinstance(a, bool) for a in args):
            return torch.bool
        return torch.int64

    def _shape_tile(self) -> str:
        return "[XBLOCK, 1]" if self.kind == "reduction" else "[XBLOCK]"

    def _emit_other(self, node: torch.fx.Node, args: list, index: tuple, dtype: torch.dtype, rdep: bool) -> _Value:
        target = node.target
        out = tl_dtype(dtype)
        cdt = compute_float(dtype) if dtype.is_floating_point else dtype
        if target == aten.where.self:
            c = self._cast(args[0], torch.bool)
            a, b = self._cast(args[1], cdt), self._cast(args[2], cdt)
            return self._new(f"tl.where({c}, {a}, {b}).to({out})", dtype, rdep)
        if target == aten.masked_fill.Scalar:
            c = self._cast(args[1], torch.bool)
            return self._new(f"tl.where({c}, {_literal(args[2])}, {self._cast(args[0], cdt)}).to({out})", dtype, rdep)
        if target in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
            x = self._cast(args[0], cdt)
            lo = args[1] if target != aten.clamp_max.default else None
            if target == aten.clamp_max.default:
                hi = args[1]
            else:
                hi = args[2] if target == aten.clamp.default and len(args) > 2 else None
            if target == aten.clamp.default:
                lo = node.kwargs.get("min", lo)
                hi = node.kwargs.get("max", hi)
            if lo is not None:
                x = f"tl.maximum({x}, {_literal(lo)}, propagate_nan=tl.PropagateNan.ALL)"
            if hi is not None:
                x = f"tl.minimum({x}, {_literal(hi)}, propagate_nan=tl.PropagateNan.ALL)"
            return self._new(f"({x}).to({out})", dtype, rdep)
        if target == aten.pow.Tensor_Scalar:
            x = self._cast(args[0], cdt)
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
                code = f"tl.exp2({_literal(float(e))} * tl.log2({x}))"
            return self._new(f"({code}).to({out})", dtype, rdep)
        if target == aten.gelu.default:
            x = self._cast(args[0], cdt)
            approximate = node.kwargs.get("approximate", args[1] if len(args) > 1 else "none")
            if approximate == "tanh":
                code = f"0.5 * {x} * (1.0 + _ds_tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))"
            else:
                code = f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"
            return self._new(f"({code}).to({out})", dtype, rdep)
        if target == aten.div.Tensor_mode:
            a, b = self._cast(args[0], cdt), self._cast(args[1], cdt)
            mode = node.kwargs.get("rounding_mode")
            code = f"({a} / {b})"
            if mode == "floor":
                code = f"tl.floor({code})"
            elif mode == "trunc":
                code = f"tl.where({code} < 0, tl.ceil({code}), tl.floor({code}))"
            return self._new(f"({code}).to({out})", dtype, rdep)
        if target in _FILL_OPS:
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
            return self._new(f"tl.full({self._shape_tile()}, {_literal(fill)}, {out})", dtype, False)
        raise CodegenUnsupported(f"no emitter for {target}")

    def _view_source_index(self, node: torch.fx.Node, index: tuple) -> tuple:
        target = node.target
        src_shape = tuple(node.args[0].meta["val"].shape)
        out_shape = tuple(node.meta["val"].shape)
        if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return reshape_index(index, out_shape, src_shape, self.ranges)
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

    def _reduce(self, node: torch.fx.Node, index: tuple) -> _Value:
        keep = _keepdim(node)
        nred = len(self.full_shape) - self.nrow
        expected = self.row_index + ((sympy.Integer(0),) * nred if keep else ())
        if tuple(sympy.expand(e) for e in index) != tuple(sympy.expand(e) for e in expected):
            raise CodegenUnsupported(f"reduction {node.name} is read at a different index than it produces")
        src = self.value(node.args[0], self.full_index)
        dtype = node.meta["val"].dtype
        kind = REDUCTION_OPS[node.target]
        if kind in ("sum", "mean"):
            acc = compute_float(dtype) if dtype.is_floating_point else torch.int64
            ident = "0"
        else:
            acc = compute_float(dtype)
            ident = 'float("-inf")' if kind == "max" else 'float("inf")'
        masked = f"tl.where(rmask, {self._cast(src, acc)}, {ident})"
        fn = {"sum": "tl.sum", "mean": "tl.sum", "max": "tl.max", "min": "tl.min"}[kind]
        code = f"{fn}({masked}, 1)[:, None]"
        if kind == "mean":
            code = f"({code} / {self.rnumel}.0)"
        return self._new(f"({code}).to({tl_dtype(dtype)})", dtype, False)

    # -- whole kernel
    def run(self) -> None:
        if self.kind == "reduction" and _next_pow2(self.rnumel) > MAX_RBLOCK:
            raise CodegenUnsupported(f"reduction width {self.rnumel} exceeds the single-pass limit {MAX_RBLOCK}")
        for pos, node in enumerate(self.outputs):
            spec = self.output_specs[pos]
            index = self.natural_index(spec.shape)
            v = self.value(node, index)
            if not isinstance(v, _Value):
                raise CodegenUnsupported(f"output {node.name} is not a tensor")
            offset = sum((e * s for e, s in zip(index, spec.stride, strict=False)), sympy.Integer(0))
            code = self._cast(v, spec.dtype)
            self.lines.append(("store", (pos, offset, self._depends_on_r(index) or v.rdep, code)))

    def _coalesce(self) -> dict[sympy.Symbol, sympy.Expr]:
        """Merge adjacent dims every access walks contiguously; return dim symbol → x/r expression."""
        exprs = [item[2] for kind, item in self.lines if kind == "load"]
        exprs += [item[1] for kind, item in self.lines if kind == "store"]
        groups = [
            [(s, z) for s, z in zip(self.syms[: self.nrow], self.full_shape[: self.nrow], strict=False) if z > 1],
            [(s, z) for s, z in zip(self.syms[self.nrow :], self.full_shape[self.nrow :], strict=False) if z > 1],
        ]
        subst: dict[sympy.Symbol, sympy.Expr] = {}
        for gi, group in enumerate(groups):
            merged = True
            while merged and len(group) > 1:
                merged = False
                for k in range(len(group) - 1):
                    (a, sa), (b, sb) = group[k], group[k + 1]
                    if all(self._mergeable(e, a, b, sb) for e in exprs):
                        c = sympy.Symbol(f"m{gi}_{a.name}_{b.name}", integer=True, nonnegative=True)
                        exprs = [e.subs({a: 0, b: c}) for e in exprs]
                        self.lines = [self._subst_line(line, {a: 0, b: c}) for line in self.lines]
                        self.ranges[c] = (0, sa * sb - 1)
                        group[k : k + 2] = [(c, sa * sb)]
                        merged = True
                        break
            base = sympy.Symbol("x" if gi == 0 else "r", integer=True, nonnegative=True)
            total = math.prod(z for _, z in group)
            self.ranges[base] = (0, max(total - 1, 0))
            inner = 1
            for sym, size in reversed(group):
                subst[sym] = modulo(floordiv(base, inner, self.ranges), size, self.ranges)
                inner *= size
        return subst

    @staticmethod
    def _mergeable(e: sympy.Expr, a: sympy.Symbol, b: sympy.Symbol, sb: int) -> bool:
        da, db = sympy.diff(e, a), sympy.diff(e, b)
        if not (da.is_Integer and db.is_Integer):
            return False
        rest = sympy.expand(e - da * a - db * b)
        if rest.has(a) or rest.has(b):
            return False
        return int(da) == int(db) * sb

    @staticmethod
    def _subst_line(line: tuple, mapping: dict) -> tuple:
        kind, item = line
        if kind == "load":
            name, pos, off, rdep = item
            return (kind, (name, pos, off.subs(mapping), rdep))
        if kind == "store":
            pos, off, rdep, code = item
            return (kind, (pos, off.subs(mapping), rdep, code))
        return line

    def source(self, name: str, int64: bool) -> str:
        subst = self._coalesce()
        ins = [f"in{i}" for i in range(len(self.inputs))]
        outs = [f"out{i}" for i in range(len(self.outputs))]
        params = ", ".join(ins + outs + ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.kind == "reduction" else []))
        body = []
        pid = "tl.program_id(0).to(tl.int64)" if int64 else "tl.program_id(0)"
        if self.kind == "reduction":
            body += [
                f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]",
                f"xmask = x < {self.xnumel}",
                "xzero = x * 0",
                "r = tl.arange(0, RBLOCK)[None, :]",
                f"rmask = r < {self.rnumel}",
            ]
        else:
            body += [f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)", f"xmask = x < {self.xnumel}", "xzero = x * 0"]
        for kind, item in self.lines:
            if kind == "code":
                body.append(item)
            elif kind == "load":
                vname, pos, off, rdep = item
                off = sympy.expand(off.subs(subst))
                mask = "xmask & rmask" if (rdep and self.kind == "reduction") else "xmask"
                body.append(f"{vname} = tl.load(in{pos} + ({print_index(off)} + xzero), mask={mask}, other=0)")
            else:
                pos, off, rdep, code = item
                off = sympy.expand(off.subs(subst))
                mask = "xmask & rmask" if (rdep and self.kind == "reduction") else "xmask"
                body.append(f"tl.store(out{pos} + ({print_index(off)} + xzero), {code}, mask={mask})")
        header = "import triton\nimport triton.language as tl\n" + _HELPERS
        text = "\n".join("    " + line for line in body)
        return f"{header}\n\n@triton.jit\ndef {name}({params}):\n{text}\n"


def region_key(
    inputs: Sequence[torch.fx.Node],
    nodes: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    input_specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec],
) -> str:
    """A structural hash: ops and their wiring, constants, and every tensor's shape/stride/dtype."""
    local: dict[torch.fx.Node, str] = {n: f"i{i}" for i, n in enumerate(inputs)}
    parts = []
    for k, node in enumerate(nodes):
        local[node] = f"n{k}"

        def norm(a: Any) -> Any:
            return local.get(a, "?") if isinstance(a, torch.fx.Node) else a

        args = torch.fx.node.map_aggregate(node.args, norm)
        kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), norm)
        val = node.meta["val"]
        parts.append(f"{node.target}|{args!r}|{sorted(kwargs.items(), key=lambda kv: kv[0])!r}|{tuple(val.shape)}|{val.dtype}")
    parts.append("out:" + ",".join(local[o] for o in outputs))
    parts.append("in:" + repr(list(input_specs)) + "out:" + repr(list(output_specs)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def generate_kernel(
    inputs: Sequence[torch.fx.Node],
    nodes: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    input_specs: Sequence[TensorSpec],
    output_specs: Sequence[TensorSpec],
    output_is_tuple: bool = True,
) -> KernelSource:
    """Plan and print the kernel for one region; raises CodegenUnsupported with a reason."""
    for node in nodes:
        reason = unsupported_reason(node)
        if reason:
            raise CodegenUnsupported(reason)
    emitter = RegionEmitter(inputs, nodes, outputs, input_specs, output_specs)
    emitter.run()
    key = region_key(inputs, nodes, outputs, input_specs, output_specs)
    name = f"ds_{emitter.kind}_{key[:12]}"
    specs = (*input_specs, *output_specs)
    extent = max([1] + [sum((d - 1) * abs(s) for d, s in zip(sp.shape, sp.stride, strict=False)) + 1 for sp in specs])
    int64 = extent >= 2**31 - 1 or emitter.xnumel * max(emitter.rnumel, 1) >= 2**31 - 1
    source = emitter.source(name, int64)
    return KernelSource(
        name=name,
        source=source,
        kind=emitter.kind,
        xnumel=emitter.xnumel,
        rnumel=emitter.rnumel,
        rblock=_next_pow2(emitter.rnumel) if emitter.kind == "reduction" else 1,
        input_specs=tuple(input_specs),
        output_specs=tuple(output_specs),
        output_is_tuple=output_is_tuple,
        key=key,
        index_int64=int64,
    )


def output_spec_for(value: torch.Tensor) -> TensorSpec:
    """Outputs keep the strides AOTAutograd traced when they are dense, else become contiguous."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

    if is_non_overlapping_and_dense(value):
        return TensorSpec.of(value)
    shape = tuple(int(s) for s in value.shape)
    return TensorSpec(shape, tuple(contiguous_strides(shape)), value.dtype)


def region_parts(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], list[torch.fx.Node], list[torch.fx.Node], bool]:
    """(placeholders, compute nodes, output nodes, output_is_tuple) of a region submodule."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    result = out_node.args[0]
    is_tuple = isinstance(result, (list, tuple))
    outputs = list(result) if is_tuple else [result]
    for o in outputs:
        if not isinstance(o, torch.fx.Node) or o in placeholders:
            raise CodegenUnsupported("region output is not computed in the region")
    return placeholders, nodes, outputs, is_tuple

"""Plan one region's kernel: choose its iteration space and generate every value on demand at an index.

A region is a set of pointwise ops, free views and reductions over trailing dims. The kernel walks an
iteration space (the reduction's input shape, or the largest output's shape); every value is generated
at an index expressed with sympy in the space's dim symbols, so broadcasts, views, permutes and slices
become index arithmetic (``index.py``, ``views.py``). Pointwise ops are printed by ``pointwise.py``,
the kernel text by ``printer.py``; what cannot be expressed raises ``CodegenUnsupported`` with a reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from dscompile.backends.triton.index import broadcast_index, reshape_index
from dscompile.backends.triton.ops import IDENTITY_OPS, REDUCTION_OPS, VIEW_OPS, keepdim, reduction_dims
from dscompile.backends.triton.pointwise import emit_pointwise
from dscompile.backends.triton.printer import kernel_source
from dscompile.backends.triton.specs import CodegenUnsupported, TensorSpec, Value, cast, compute_float, tl_dtype
from dscompile.backends.triton.views import view_source_index

# Largest reduction width a single-pass kernel keeps in one tile.
MAX_RBLOCK = 65536


def next_pow2(n: int) -> int:
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
        self.memo: dict[tuple, Value] = {}
        self.counter = 0
        self._choose_space()

    # -- iteration space
    def _choose_space(self) -> None:
        reductions = [n for n in self.nodes if n.target in REDUCTION_OPS]
        if reductions:
            spaces = set()
            for node in reductions:
                shape = tuple(node.args[0].meta["val"].shape)
                dims = reduction_dims(node)
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
    def new(self, code: str, dtype: torch.dtype, rdep: bool) -> Value:
        """A fresh value computed by ``code``."""
        name = f"v{self.counter}"
        self.counter += 1
        self.lines.append(("code", f"{name} = {code}"))
        return Value(name, dtype, rdep)

    def _depends_on_r(self, index: Sequence[sympy.Expr]) -> bool:
        return any(e.free_symbols & self.rsyms for e in index)

    def shape_tile(self) -> str:
        return "[XBLOCK, 1]" if self.kind == "reduction" else "[XBLOCK]"

    # -- on-demand generation
    def value(self, node: Any, index: tuple) -> Value | Any:
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

    def _load(self, node: torch.fx.Node, index: tuple) -> Value:
        spec = self.input_specs[self.input_pos[node]]
        if len(index) != len(spec.shape):
            raise CodegenUnsupported(f"rank mismatch loading {node.name}")
        offset = sum((e * s for e, s in zip(index, spec.stride, strict=False)), sympy.Integer(0))
        rdep = self._depends_on_r(index)
        name = f"v{self.counter}"
        self.counter += 1
        self.lines.append(("load", (name, self.input_pos[node], offset, rdep)))
        return Value(name, spec.dtype, rdep)

    def _arg_index(self, arg: torch.fx.Node, out_shape: tuple, index: tuple) -> tuple:
        return broadcast_index(index, out_shape, tuple(arg.meta["val"].shape))

    def _emit(self, node: torch.fx.Node, index: tuple) -> Value:
        target = node.target
        val = node.meta["val"]
        out_shape = tuple(val.shape)
        dtype = val.dtype
        if target in VIEW_OPS:
            src = node.args[0]
            return self.value(src, view_source_index(node, index, self.ranges))
        if target in REDUCTION_OPS:
            return self._reduce(node, index)
        args = [self.value(a, self._arg_index(a, out_shape, index)) if isinstance(a, torch.fx.Node) else a for a in node.args]
        rdep = any(isinstance(a, Value) and a.rdep for a in args)
        if target in IDENTITY_OPS:
            return args[0]
        return emit_pointwise(self, node, args, dtype, rdep)

    def _reduce(self, node: torch.fx.Node, index: tuple) -> Value:
        keep = keepdim(node)
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
        masked = f"tl.where(rmask, {cast(src, acc)}, {ident})"
        fn = {"sum": "tl.sum", "mean": "tl.sum", "max": "tl.max", "min": "tl.min"}[kind]
        code = f"{fn}({masked}, 1)[:, None]"
        if kind == "mean":
            code = f"({code} / {self.rnumel}.0)"
        return self.new(f"({code}).to({tl_dtype(dtype)})", dtype, False)

    # -- whole kernel
    def run(self) -> None:
        if self.kind == "reduction" and next_pow2(self.rnumel) > MAX_RBLOCK:
            raise CodegenUnsupported(f"reduction width {self.rnumel} exceeds the single-pass limit {MAX_RBLOCK}")
        for pos, node in enumerate(self.outputs):
            spec = self.output_specs[pos]
            index = self.natural_index(spec.shape)
            v = self.value(node, index)
            if not isinstance(v, Value):
                raise CodegenUnsupported(f"output {node.name} is not a tensor")
            offset = sum((e * s for e, s in zip(index, spec.stride, strict=False)), sympy.Integer(0))
            code = cast(v, spec.dtype)
            self.lines.append(("store", (pos, offset, self._depends_on_r(index) or v.rdep, code)))

    def source(self, name: str, int64: bool) -> str:
        return kernel_source(self, name, int64)

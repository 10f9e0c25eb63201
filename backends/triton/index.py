"""Index arithmetic for generated kernels: sympy expressions over the iteration space's dim symbols.

Broadcasts, reshapes, permutes and slices become index expressions; ``floordiv``/``modulo`` drop what the
symbols' known ranges make redundant, and ``print_index`` writes what is left as Triton source.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

from dscompile.backends.triton.specs import CodegenUnsupported, contiguous_strides


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

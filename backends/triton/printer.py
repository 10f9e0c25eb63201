"""Print an emitter's collected lines as one Triton kernel.

Adjacent dims that every load and store walks contiguously are merged first (fewer divisions and
moduli per element), then each dim becomes a division/modulo of the flat ``x`` (rows) or ``r``
(reduction) offset and every offset is printed as Triton source.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import sympy

from dscompile.backends.triton.index import floordiv, modulo, print_index

if TYPE_CHECKING:
    from dscompile.backends.triton.emitter import RegionEmitter


HELPERS = '''
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


def kernel_source(em: RegionEmitter, name: str, int64: bool) -> str:
    """The kernel's Triton source: the launch prologue, then the emitter's lines with their offsets printed."""
    subst = coalesce(em)
    ins = [f"in{i}" for i in range(len(em.inputs))]
    outs = [f"out{i}" for i in range(len(em.outputs))]
    params = ", ".join(ins + outs + ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if em.kind == "reduction" else []))
    body = []
    pid = "tl.program_id(0).to(tl.int64)" if int64 else "tl.program_id(0)"
    if em.kind == "reduction":
        body += [
            f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]",
            f"xmask = x < {em.xnumel}",
            "xzero = x * 0",
            "r = tl.arange(0, RBLOCK)[None, :]",
            f"rmask = r < {em.rnumel}",
        ]
    else:
        body += [f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)", f"xmask = x < {em.xnumel}", "xzero = x * 0"]
    for kind, item in em.lines:
        if kind == "code":
            body.append(item)
        elif kind == "load":
            vname, pos, off, rdep = item
            off = sympy.expand(off.subs(subst))
            mask = "xmask & rmask" if (rdep and em.kind == "reduction") else "xmask"
            body.append(f"{vname} = tl.load(in{pos} + ({print_index(off)} + xzero), mask={mask}, other=0)")
        else:
            pos, off, rdep, code = item
            off = sympy.expand(off.subs(subst))
            mask = "xmask & rmask" if (rdep and em.kind == "reduction") else "xmask"
            body.append(f"tl.store(out{pos} + ({print_index(off)} + xzero), {code}, mask={mask})")
    header = "import triton\nimport triton.language as tl\n" + HELPERS
    text = "\n".join("    " + line for line in body)
    return f"{header}\n\n@triton.jit\ndef {name}({params}):\n{text}\n"


def coalesce(em: RegionEmitter) -> dict[sympy.Symbol, sympy.Expr]:
    """Merge adjacent dims every access walks contiguously; return dim symbol → x/r expression."""
    exprs = [item[2] for kind, item in em.lines if kind == "load"]
    exprs += [item[1] for kind, item in em.lines if kind == "store"]
    groups = [
        [(s, z) for s, z in zip(em.syms[: em.nrow], em.full_shape[: em.nrow], strict=False) if z > 1],
        [(s, z) for s, z in zip(em.syms[em.nrow :], em.full_shape[em.nrow :], strict=False) if z > 1],
    ]
    subst: dict[sympy.Symbol, sympy.Expr] = {}
    for gi, group in enumerate(groups):
        merged = True
        while merged and len(group) > 1:
            merged = False
            for k in range(len(group) - 1):
                (a, sa), (b, sb) = group[k], group[k + 1]
                if all(_mergeable(e, a, b, sb) for e in exprs):
                    c = sympy.Symbol(f"m{gi}_{a.name}_{b.name}", integer=True, nonnegative=True)
                    exprs = [e.subs({a: 0, b: c}) for e in exprs]
                    em.lines = [_subst_line(line, {a: 0, b: c}) for line in em.lines]
                    em.ranges[c] = (0, sa * sb - 1)
                    group[k : k + 2] = [(c, sa * sb)]
                    merged = True
                    break
        base = sympy.Symbol("x" if gi == 0 else "r", integer=True, nonnegative=True)
        total = math.prod(z for _, z in group)
        em.ranges[base] = (0, max(total - 1, 0))
        inner = 1
        for sym, size in reversed(group):
            subst[sym] = modulo(floordiv(base, inner, em.ranges), size, em.ranges)
            inner *= size
    return subst


def _mergeable(e: sympy.Expr, a: sympy.Symbol, b: sympy.Symbol, sb: int) -> bool:
    da, db = sympy.diff(e, a), sympy.diff(e, b)
    if not (da.is_Integer and db.is_Integer):
        return False
    rest = sympy.expand(e - da * a - db * b)
    if rest.has(a) or rest.has(b):
        return False
    return int(da) == int(db) * sb


def _subst_line(line: tuple, mapping: dict) -> tuple:
    kind, item = line
    if kind == "load":
        name, pos, off, rdep = item
        return (kind, (name, pos, off.subs(mapping), rdep))
    if kind == "store":
        pos, off, rdep, code = item
        return (kind, (pos, off.subs(mapping), rdep, code))
    return line
